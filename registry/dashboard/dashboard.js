// The fleet dashboard: every site on a world map, live from the registry's admin API.
//
// The admin token is asked for once per browser tab and kept in sessionStorage; it travels only in
// the Authorization header of this registry's /v1/admin calls, never in a URL. The map's country
// outlines are Natural Earth 110m (public domain) as TopoJSON, served by the registry itself, and
// drawn in an equirectangular projection. Plain DOM and SVG, no libraries, no build step.
"use strict";

const TOKEN_KEY = "edgefire.adminToken";
const WIDTH = 1000, HEIGHT = 500;              // the whole world, 1 degree = WIDTH / 360 units
const PLACEMENT_WINDOW_S = 300;
const SVG_NS = "http://www.w3.org/2000/svg";

const state = { sites: [], pairs: [], world: null, view: "sites", timer: null, intervalMs: 2000, generatedAt: 0,
                hovered: null,     // the site under the pointer: its tooltip follows each refresh
                session: 0 };      // bumped at each sign-out: a refresh begun before it schedules no other

class AuthError extends Error {}

// -- admin API ---------------------------------------------------------------------------------

async function api(path) {
  const response = await fetch(path, {
    headers: { Authorization: "Bearer " + sessionStorage.getItem(TOKEN_KEY) },
    cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer",
  });
  if (response.status === 401 || response.status === 403) {
    throw new AuthError("the registry refused this admin token");
  }
  if (!response.ok) {
    throw new Error(`${path} answered HTTP ${response.status}`);
  }
  return response.json();
}

async function refresh(session) {
  const [snapshot, placements] = await Promise.all([
    api("/v1/admin/snapshot"), api(`/v1/admin/placements?window_s=${PLACEMENT_WINDOW_S}`),
  ]);
  if (session !== state.session) return;   // signed out meanwhile: nothing of it stays on the page
  state.sites = snapshot.sites;
  state.generatedAt = snapshot.generated_at;
  state.pairs = placements.pairs;
  render();
}

// -- what a site looks like ----------------------------------------------------------------------

function status(site) {            // active | cordoned | draining | dead: the colour
  if (!site.alive) return "dead";
  if (site.state === "active" && site.capacity && site.capacity.draining) return "draining";
  return site.state;
}

function stateText(site) {         // what the state column and tooltip say: agrees with the colour
  const state = site.state === "active" && site.capacity && site.capacity.draining ? "active, draining" : site.state;
  return site.alive ? state : `${state}, dead`;
}

function role(site) {              // prefill | decode | both | none: what the site takes work in now
  const roles = site.role_offer.roles;   // the registry's one rule (registry/wire.py), the pool planner's pick included
  return roles.length === 2 ? "both" : roles[0] || "none";
}

function roleText(site) {          // as `edgefire status` words it: "both (now prefill)" for a site the planner narrowed
  const now = role(site);
  const configured = site.role_offer.flexible ? "both" : now;
  return now === configured ? now : `${configured} (now ${now})`;
}

function load(site) {
  const cap = site.capacity;
  return cap ? cap.num_running + cap.num_waiting : 0;
}

function kvFree(site) {
  const cap = site.capacity;
  if (!cap) return "-";
  const pct = Math.round((100 * cap.kv_blocks_free) / Math.max(1, cap.kv_blocks_total));
  return `${cap.kv_blocks_free}/${cap.kv_blocks_total} (${pct}%)`;
}

function heartbeat(site) {
  const age = site.heartbeat_age_s;
  return age === null || age === undefined ? "never" : `${age.toFixed(1)} s ago`;
}

function located(site) {
  return typeof site.lat === "number" && typeof site.lon === "number";
}

// -- projection and view -------------------------------------------------------------------------

function project(lon, lat) {
  return [((lon + 180) / 360) * WIDTH, ((90 - lat) / 180) * HEIGHT];
}

function viewBox() {               // [x, y, width, height] in map units
  const points = state.sites.filter(located).map((s) => project(s.lon, s.lat));
  if (state.view === "world" || points.length === 0) return [0, 0, WIDTH, HEIGHT];
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const pad = (WIDTH / 360) * 8;   // 8 degrees around the sites
  let x0 = Math.min(...xs) - pad, x1 = Math.max(...xs) + pad;
  let y0 = Math.min(...ys) - pad, y1 = Math.max(...ys) + pad;
  let w = Math.max(x1 - x0, (WIDTH / 360) * 30), h = Math.max(y1 - y0, (HEIGHT / 180) * 15);
  if (w / h > WIDTH / HEIGHT) h = w * (HEIGHT / WIDTH); else w = h * (WIDTH / HEIGHT);
  const cx = (x0 + x1) / 2, cy = (y0 + y1) / 2;
  return [cx - w / 2, cy - h / 2, w, h];
}

// -- TopoJSON (https://github.com/topojson/topojson-specification) -------------------------------

function decodeArcs(topology) {
  const [sx, sy] = topology.transform.scale, [tx, ty] = topology.transform.translate;
  return topology.arcs.map((arc) => {
    let x = 0, y = 0;
    return arc.map(([dx, dy]) => { x += dx; y += dy; return [x * sx + tx, y * sy + ty]; });
  });
}

function ringPoints(arcs, indices) {
  const points = [];
  for (const index of indices) {
    const arc = index >= 0 ? arcs[index] : arcs[~index].slice().reverse();
    points.push(...(points.length ? arc.slice(1) : arc));   // consecutive arcs share an end point
  }
  return points;
}

// A ring that crosses the antimeridian (Russia, Fiji) would be drawn with a line across the whole map:
// its longitudes are unwrapped into one continuous run, and a copy shifted by 360 degrees draws the
// part beyond the map's edge on the other side. A ring around a pole (Antarctica) crosses once; it is
// closed along that pole.
function unwrappedRings(points) {
  let shift = 0;
  const out = [points[0]];
  for (let i = 1; i < points.length; i++) {
    const step = points[i][0] - points[i - 1][0];
    if (step > 180) shift -= 360; else if (step < -180) shift += 360;
    out.push([points[i][0] + shift, points[i][1]]);
  }
  if (shift !== 0) {
    const pole = out.reduce((sum, p) => sum + p[1], 0) < 0 ? -90 : 90;
    out.push([out[out.length - 1][0], pole], [out[0][0], pole]);
  }
  const lons = out.map((p) => p[0]);
  const rings = [out];
  if (Math.max(...lons) > 180) rings.push(out.map(([lon, lat]) => [lon - 360, lat]));
  if (Math.min(...lons) < -180) rings.push(out.map(([lon, lat]) => [lon + 360, lat]));
  return rings;
}

function countryPaths(topology) {
  const arcs = decodeArcs(topology);
  return topology.objects.countries.geometries.map((geometry) => {
    const polygons = geometry.type === "Polygon" ? [geometry.arcs]
      : geometry.type === "MultiPolygon" ? geometry.arcs : [];
    const rings = polygons.flatMap((polygon) => polygon.flatMap((ring) => unwrappedRings(ringPoints(arcs, ring))));
    const d = rings.map((ring) => "M" + ring.map(([lon, lat]) => project(lon, lat).map((v) => v.toFixed(1))
      .join(",")).join("L") + "Z").join("");
    return { name: (geometry.properties && geometry.properties.name) || "", d };
  });
}

async function loadWorld() {
  const response = await fetch("/dashboard/countries-110m.json", { credentials: "omit" });
  if (!response.ok) throw new Error(`the map outlines answered HTTP ${response.status}`);
  const group = document.getElementById("countries");
  for (const country of countryPaths(await response.json())) {
    const path = svg("path", { d: country.d });
    path.append(svg("title", {}, country.name));
    group.append(path);
  }
}

// -- drawing ---------------------------------------------------------------------------------------

function svg(tag, attributes, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function marker(kind, r) {         // both: circle, prefill: square, decode: triangle
  if (kind === "prefill") return svg("rect", { class: "mark", x: -r, y: -r, width: 2 * r, height: 2 * r });
  if (kind === "decode") {
    const h = r * 1.2;
    return svg("polygon", { class: "mark", points: `0,${-h} ${h},${h * 0.8} ${-h},${h * 0.8}` });
  }
  return svg("circle", { class: "mark", r });
}

function tooltipText(site) {
  const cap = site.capacity;
  return [
    site.name + (site.region ? `  (${site.region}${site.country ? ", " + site.country : ""})` : ""),
    `state ${stateText(site)}${site.alive ? "" : " (no live heartbeat)"}`,
    `role ${roleText(site)}`,
    `load ${cap ? `${cap.num_running} running, ${cap.num_waiting} waiting` : "-"}`,
    `KV free ${kvFree(site)}`,
    `heartbeat ${heartbeat(site)}`,
  ].join("\n");
}

function drawSites(scale) {
  const group = document.getElementById("sites");
  group.replaceChildren();
  for (const site of state.sites.filter(located)) {
    const [x, y] = project(site.lon, site.lat);
    const r = Math.min(20, 6 + 3 * Math.sqrt(load(site))) * scale;
    const node = svg("g", { class: `site status-${status(site)}`, transform: `translate(${x},${y})`,
                            "data-site": site.name, "data-state": site.state, "data-status": status(site),
                            "data-role": role(site) });
    node.append(marker(role(site), r), svg("text", { x: r + 3 * scale, y: 4 * scale, "font-size": 12 * scale },
                                           site.name));
    node.append(svg("title", {}, tooltipText(site)));
    node.addEventListener("mousemove", (event) => showTooltip(event, site));
    node.addEventListener("mouseleave", hideTooltip);
    group.append(node);
  }
}

function drawArcs(scale) {
  const group = document.getElementById("arcs");
  group.replaceChildren();
  const where = new Map(state.sites.filter(located).map((s) => [s.name, project(s.lon, s.lat)]));
  for (const pair of state.pairs) {
    const from = where.get(pair.prefill_site), to = where.get(pair.decode_site);
    if (!from || !to || pair.prefill_site === pair.decode_site) continue;
    const [mx, my] = [(from[0] + to[0]) / 2, (from[1] + to[1]) / 2];
    const [dx, dy] = [to[0] - from[0], to[1] - from[1]];
    const [cx, cy] = [mx - dy * 0.25, my + dx * 0.25];    // bend to one side: A→B and B→A stay apart
    const path = svg("path", { d: `M${from[0]},${from[1]} Q${cx},${cy} ${to[0]},${to[1]}`, "marker-end": "url(#arrow)",
                               "stroke-width": (1 + Math.log2(pair.num_requests)).toFixed(2),
                               "data-pair": `${pair.prefill_site}>${pair.decode_site}` });
    path.append(svg("title", {}, `${pair.prefill_site} → ${pair.decode_site}: ${pair.num_requests} request(s)`));
    group.append(path);
  }
}

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  row.append(td);
}

function drawTables() {
  const body = document.querySelector("#sites-table tbody");
  body.replaceChildren(...state.sites.map((site) => {
    const row = document.createElement("tr");
    row.className = `status-${status(site)}`;
    Object.assign(row.dataset, { site: site.name, state: site.state, status: status(site) });
    cell(row, site.name);
    cell(row, stateText(site), "status");
    cell(row, roleText(site));
    cell(row, site.region || "-");
    cell(row, site.capacity ? `${site.capacity.num_running}/${site.capacity.num_waiting}` : "-");
    cell(row, kvFree(site));
    cell(row, heartbeat(site));
    return row;
  }));
  const pairs = document.querySelector("#pairs-table tbody");
  pairs.replaceChildren(...state.pairs.map((pair) => {
    const row = document.createElement("tr");
    cell(row, pair.prefill_site);
    cell(row, pair.decode_site === pair.prefill_site ? `${pair.decode_site} (same site)` : pair.decode_site);
    cell(row, String(pair.num_requests));
    return row;
  }));
}

function render() {
  const box = viewBox();
  document.getElementById("map").setAttribute("viewBox", box.map((v) => v.toFixed(1)).join(" "));
  const scale = box[2] / WIDTH;    // markers keep their size on screen whatever the zoom
  drawArcs(scale);
  drawSites(scale);
  drawTables();
  const hovered = state.sites.find((s) => s.name === state.hovered);
  if (hovered) document.getElementById("tooltip").textContent = tooltipText(hovered);
  else hideTooltip();
  const alive = state.sites.filter((s) => s.alive).length;
  document.getElementById("summary").textContent = `${state.sites.length} sites, ${alive} alive`;
  document.getElementById("updated").textContent =
    `updated ${new Date(state.generatedAt * 1000).toLocaleTimeString()}`;
}

function showTooltip(event, site) {
  const tip = document.getElementById("tooltip");
  const box = document.getElementById("map-box").getBoundingClientRect();
  state.hovered = site.name;
  tip.textContent = tooltipText(site);
  tip.style.left = `${event.clientX - box.left + 14}px`;
  tip.style.top = `${event.clientY - box.top + 14}px`;
  tip.hidden = false;
}

function hideTooltip() {
  state.hovered = null;
  document.getElementById("tooltip").hidden = true;
}

// -- the loop, sign-in and sign-out ----------------------------------------------------------------

async function tick() {
  state.timer = null;
  const session = state.session;
  const banner = document.getElementById("banner");
  try {
    await refresh(session);
    if (session !== state.session) return;    // signed out while it was in flight
    banner.hidden = true;
  } catch (error) {
    if (session !== state.session) return;
    if (error instanceof AuthError) {
      signOut(error.message);
      return;
    }
    banner.textContent = `Cannot refresh from the registry (${error.message}); trying again.`;
    banner.hidden = false;
  }
  state.timer = setTimeout(tick, state.intervalMs);
}

function showFleet() {
  document.getElementById("login").hidden = true;
  document.getElementById("fleet").hidden = false;
  if (state.world === null) {
    state.world = loadWorld().catch((error) => {
      const banner = document.getElementById("banner");
      banner.textContent = `The map outlines did not load (${error.message}); sites are drawn without them.`;
      banner.hidden = false;
    });
  }
  if (state.timer === null) tick();
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  state.session += 1;
  clearTimeout(state.timer);
  state.timer = null;
  document.getElementById("fleet").hidden = true;
  document.getElementById("login").hidden = false;
  document.getElementById("login-error").textContent = message || "";
  document.getElementById("token").focus();
}

async function signIn(event) {
  event.preventDefault();
  const input = document.getElementById("token");
  const error = document.getElementById("login-error");
  sessionStorage.setItem(TOKEN_KEY, input.value.trim());
  input.value = "";
  try {
    await api("/v1/admin/snapshot");
  } catch (failure) {
    sessionStorage.removeItem(TOKEN_KEY);
    error.textContent = failure instanceof AuthError ? "The registry refused this admin token."
      : `Cannot reach the registry (${failure.message}).`;
    return;
  }
  error.textContent = "";
  showFleet();
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("login-form").addEventListener("submit", signIn);
  document.getElementById("logout").addEventListener("click", () => signOut(""));
  document.getElementById("interval").addEventListener("change", (event) => {
    state.intervalMs = Number(event.target.value);
  });
  document.getElementById("view").addEventListener("click", (event) => {
    state.view = state.view === "world" ? "sites" : "world";
    event.target.textContent = state.view === "world" ? "Fit sites" : "World";
    render();
  });
  if (sessionStorage.getItem(TOKEN_KEY)) showFleet(); else signOut("");
});
