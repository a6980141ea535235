"""Great-circle distance and the round-trip time it implies when no link has been measured."""

from __future__ import annotations

import math

import numpy as np

EARTH_RADIUS_KM = 6371.0
# Light in fibre covers ~200 km per ms one way; real paths run ~1.5x the great circle, so a round
# trip costs ~0.015 ms per km of distance, plus a fixed cost for the last mile and the handshake.
RTT_MS_PER_KM = 0.015
RTT_BASE_MS = 1.0
UNKNOWN_DISTANCE_RTT_MS = 150.0  # a site without coordinates is assumed far away, not near


def distance_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    phi1, phi2 = math.radians(lat1), math.radians(lat2)
    dphi, dlambda = phi2 - phi1, math.radians(lon2 - lon1)
    a = math.sin(dphi / 2) ** 2 + math.cos(phi1) * math.cos(phi2) * math.sin(dlambda / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(a)))


def rtt_ms_between(lat1: float | None, lon1: float | None, lat2: float | None, lon2: float | None) -> float:
    if None in (lat1, lon1, lat2, lon2):
        return UNKNOWN_DISTANCE_RTT_MS
    return RTT_BASE_MS + RTT_MS_PER_KM * distance_km(lat1, lon1, lat2, lon2)


def rtt_ms_arrays(lat1_rad, lon1_rad, lat2_rad, lon2_rad, cos_lat1=None, cos_lat2=None) -> np.ndarray:
    """`rtt_ms_between` over arrays of coordinates in radians (placement's per-request form); the
    cosines may be passed in when they are computed once per site."""
    cos_lat1 = np.cos(lat1_rad) if cos_lat1 is None else cos_lat1
    cos_lat2 = np.cos(lat2_rad) if cos_lat2 is None else cos_lat2
    a = np.sin((lat2_rad - lat1_rad) / 2) ** 2 + cos_lat1 * cos_lat2 * np.sin((lon2_rad - lon1_rad) / 2) ** 2
    return RTT_BASE_MS + RTT_MS_PER_KM * 2 * EARTH_RADIUS_KM * np.arcsin(np.minimum(1.0, np.sqrt(a)))
