"""Placement at scale: 300 sites at real city coordinates, 100,000 placements through `rank()`.

    .venv/bin/python benchmarks/placement_sim.py [--placements 100000] [--refresh-every 1000] [--seed 1]

One site in each of the 300 most populous cities below (real latitude and longitude), each with
synthetic load drawn per snapshot, a fleet at moderate and uneven use: running sequences (0-32,
median 4), in-flight prefill and decode tokens, KV in use, measured prefill and decode rates
(three hardware classes within ±20% of each other) with the load they were measured under, a
prefix-cache summary of some of the shared system prompts (those of the first running sequences held,
the rest evictable), and measured links between some sites of one region. One site in ten serves only prefill, one in ten only decode. A fresh
snapshot is drawn every `--refresh-every` placements (a router refreshes about once a second), so
whatever `rank()` prepares per snapshot is paid again.

Clients stand near any of the cities (sites or not), drawn in proportion to its population weight
(jittered by up to ~50 km); prompts are 50–4,000 tokens, half of them opening with one of the
shared system prompts; max_tokens 16–512; the model's KV bytes per token is 128 KiB (a
Llama-3-8B-like model in bf16).

Printed, all from the same run: p50/p99/max wall time per `rank()` call and p50/p99 of the CPU
time this process spent in it (on a loaded machine the wall time includes waiting for a core;
the first call after each refresh, which builds the snapshot's arrays, is shown apart), the mean
client round trip to the chosen decode site against a nearest-site oracle (the nearest site that
could take the request at all, by distance), how often the chosen site is that nearest one and
by how much the cost model prefers its choice (score: expected time to first token plus the
decode horizon), and the share of split vs colocated placements.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from engine.prefix_hash import prefix_hashes  # noqa: E402
from router.geometry import rtt_ms_between  # noqa: E402
from router.placement import CostModel, PlacementRequest, is_live, rank  # noqa: E402
from router.snapshot import Snapshot, parse_snapshot  # noqa: E402

MODEL = "llama-3-8b"
KV_BYTES_PER_TOKEN = 131072
BLOCK_SIZE = 16

# (city, latitude, longitude, region, population weight in millions, roughly the metro area)
CITIES = [
    # Europe
    ("London", 51.507, -0.128, "eu", 14), ("Paris", 48.857, 2.352, "eu", 12), ("Madrid", 40.417, -3.704, "eu", 7),
    ("Barcelona", 41.385, 2.173, "eu", 5), ("Lisbon", 38.722, -9.139, "eu", 3), ("Porto", 41.158, -8.629, "eu", 2),
    ("Berlin", 52.520, 13.405, "eu", 6), ("Hamburg", 53.551, 9.994, "eu", 3), ("Munich", 48.137, 11.576, "eu", 3),
    ("Frankfurt", 50.110, 8.682, "eu", 3), ("Cologne", 50.938, 6.960, "eu", 2), ("Stuttgart", 48.776, 9.183, "eu", 2),
    ("Dusseldorf", 51.228, 6.773, "eu", 2), ("Leipzig", 51.340, 12.375, "eu", 1),
    ("Amsterdam", 52.368, 4.904, "eu", 3),
    ("Rotterdam", 51.924, 4.478, "eu", 2), ("Brussels", 50.850, 4.352, "eu", 3), ("Antwerp", 51.219, 4.402, "eu", 1),
    ("Luxembourg", 49.612, 6.130, "eu", 1), ("Zurich", 47.377, 8.541, "eu", 2), ("Geneva", 46.204, 6.143, "eu", 1),
    ("Vienna", 48.208, 16.374, "eu", 3), ("Prague", 50.076, 14.438, "eu", 2), ("Warsaw", 52.230, 21.012, "eu", 3),
    ("Krakow", 50.065, 19.945, "eu", 1), ("Wroclaw", 51.108, 17.039, "eu", 1), ("Gdansk", 54.352, 18.647, "eu", 1),
    ("Budapest", 47.498, 19.040, "eu", 3), ("Bratislava", 48.149, 17.107, "eu", 1),
    ("Ljubljana", 46.057, 14.506, "eu", 1),
    ("Zagreb", 45.815, 15.982, "eu", 1), ("Belgrade", 44.787, 20.457, "eu", 2), ("Sarajevo", 43.856, 18.413, "eu", 1),
    ("Sofia", 42.698, 23.322, "eu", 1), ("Bucharest", 44.427, 26.103, "eu", 2),
    ("Cluj-Napoca", 46.771, 23.624, "eu", 1),
    ("Athens", 37.984, 23.728, "eu", 4), ("Thessaloniki", 40.640, 22.944, "eu", 1), ("Rome", 41.903, 12.496, "eu", 4),
    ("Milan", 45.464, 9.190, "eu", 5), ("Naples", 40.852, 14.268, "eu", 3), ("Turin", 45.070, 7.687, "eu", 2),
    ("Bologna", 44.494, 11.343, "eu", 1), ("Florence", 43.770, 11.256, "eu", 1), ("Palermo", 38.116, 13.361, "eu", 1),
    ("Marseille", 43.296, 5.370, "eu", 2), ("Lyon", 45.764, 4.836, "eu", 2), ("Toulouse", 43.605, 1.444, "eu", 1),
    ("Bordeaux", 44.838, -0.579, "eu", 1), ("Nantes", 47.218, -1.554, "eu", 1), ("Lille", 50.629, 3.057, "eu", 1),
    ("Strasbourg", 48.573, 7.752, "eu", 1), ("Nice", 43.710, 7.262, "eu", 1), ("Valencia", 39.470, -0.376, "eu", 2),
    ("Seville", 37.389, -5.984, "eu", 1), ("Bilbao", 43.263, -2.935, "eu", 1), ("Dublin", 53.350, -6.260, "eu", 2),
    ("Cork", 51.899, -8.476, "eu", 1), ("Manchester", 53.481, -2.243, "eu", 3),
    ("Birmingham", 52.486, -1.890, "eu", 3),
    ("Leeds", 53.801, -1.549, "eu", 2), ("Glasgow", 55.864, -4.252, "eu", 2), ("Edinburgh", 55.953, -3.189, "eu", 1),
    ("Bristol", 51.455, -2.588, "eu", 1), ("Belfast", 54.597, -5.930, "eu", 1),
    ("Copenhagen", 55.676, 12.568, "eu", 2),
    ("Aarhus", 56.163, 10.204, "eu", 1), ("Stockholm", 59.329, 18.069, "eu", 2),
    ("Gothenburg", 57.709, 11.975, "eu", 1),
    ("Malmo", 55.605, 13.004, "eu", 1), ("Oslo", 59.914, 10.752, "eu", 1), ("Bergen", 60.393, 5.324, "eu", 1),
    ("Helsinki", 60.170, 24.938, "eu", 1), ("Tallinn", 59.437, 24.754, "eu", 1), ("Riga", 56.950, 24.105, "eu", 1),
    ("Vilnius", 54.687, 25.280, "eu", 1), ("Reykjavik", 64.147, -21.943, "eu", 1), ("Kyiv", 50.450, 30.523, "eu", 3),
    ("Lviv", 49.840, 24.030, "eu", 1), ("Odesa", 46.482, 30.723, "eu", 1), ("Chisinau", 47.011, 28.864, "eu", 1),
    ("Minsk", 53.905, 27.560, "eu", 2), ("Moscow", 55.756, 37.617, "eu", 17),
    ("Saint Petersburg", 59.939, 30.316, "eu", 5),
    ("Istanbul", 41.008, 28.978, "eu", 15), ("Ankara", 39.934, 32.860, "me", 5), ("Izmir", 38.423, 27.143, "me", 3),
    ("Valletta", 35.899, 14.514, "eu", 1), ("Nicosia", 35.186, 33.382, "me", 1), ("Tirana", 41.328, 19.819, "eu", 1),
    ("Skopje", 41.997, 21.428, "eu", 1), ("Podgorica", 42.441, 19.263, "eu", 1), ("Graz", 47.071, 15.439, "eu", 1),
    ("Salzburg", 47.810, 13.055, "eu", 1), ("Basel", 47.560, 7.589, "eu", 1), ("Nuremberg", 49.452, 11.077, "eu", 1),
    ("Hanover", 52.376, 9.732, "eu", 1), ("Dresden", 51.050, 13.738, "eu", 1), ("Poznan", 52.406, 16.925, "eu", 1),
    ("Brno", 49.195, 16.607, "eu", 1), ("Eindhoven", 51.441, 5.470, "eu", 1), ("Tbilisi", 41.716, 44.783, "me", 1),
    ("Yerevan", 40.179, 44.499, "me", 1), ("Baku", 40.409, 49.867, "me", 2),
    # North America
    ("New York", 40.713, -74.006, "na", 20), ("Los Angeles", 34.052, -118.244, "na", 13),
    ("Chicago", 41.878, -87.630, "na", 9),
    ("Houston", 29.760, -95.370, "na", 7), ("Dallas", 32.777, -96.797, "na", 8),
    ("Phoenix", 33.448, -112.074, "na", 5),
    ("Philadelphia", 39.953, -75.165, "na", 6), ("San Antonio", 29.424, -98.494, "na", 3),
    ("San Diego", 32.716, -117.161, "na", 3),
    ("San Jose", 37.339, -121.895, "na", 2), ("San Francisco", 37.775, -122.419, "na", 5),
    ("Seattle", 47.606, -122.332, "na", 4),
    ("Portland", 45.515, -122.679, "na", 2), ("Denver", 39.739, -104.990, "na", 3),
    ("Salt Lake City", 40.761, -111.891, "na", 1),
    ("Las Vegas", 36.170, -115.140, "na", 2), ("Austin", 30.267, -97.743, "na", 2),
    ("Atlanta", 33.749, -84.388, "na", 6),
    ("Miami", 25.762, -80.192, "na", 6), ("Tampa", 27.951, -82.457, "na", 3), ("Orlando", 28.538, -81.379, "na", 3),
    ("Washington", 38.907, -77.037, "na", 6), ("Baltimore", 39.290, -76.612, "na", 3),
    ("Boston", 42.360, -71.059, "na", 5),
    ("Pittsburgh", 40.441, -79.996, "na", 2), ("Detroit", 42.331, -83.046, "na", 4),
    ("Cleveland", 41.499, -81.694, "na", 2),
    ("Columbus", 39.961, -82.999, "na", 2), ("Cincinnati", 39.103, -84.512, "na", 2),
    ("Indianapolis", 39.768, -86.158, "na", 2),
    ("Minneapolis", 44.978, -93.265, "na", 4), ("St. Louis", 38.627, -90.199, "na", 3),
    ("Kansas City", 39.100, -94.579, "na", 2),
    ("Nashville", 36.163, -86.781, "na", 2), ("Charlotte", 35.227, -80.843, "na", 3),
    ("Raleigh", 35.780, -78.639, "na", 2),
    ("New Orleans", 29.951, -90.072, "na", 1), ("Oklahoma City", 35.468, -97.516, "na", 1),
    ("Albuquerque", 35.084, -106.650, "na", 1),
    ("Sacramento", 38.582, -121.494, "na", 2), ("Boise", 43.615, -116.202, "na", 1),
    ("Omaha", 41.257, -95.935, "na", 1),
    ("Milwaukee", 43.039, -87.906, "na", 2), ("Buffalo", 42.886, -78.878, "na", 1),
    ("Richmond", 37.541, -77.436, "na", 1),
    ("Jacksonville", 30.332, -81.656, "na", 1), ("Memphis", 35.150, -90.049, "na", 1),
    ("Honolulu", 21.307, -157.858, "na", 1),
    ("Anchorage", 61.218, -149.900, "na", 1), ("Toronto", 43.653, -79.383, "na", 6),
    ("Montreal", 45.502, -73.567, "na", 4),
    ("Vancouver", 49.283, -123.121, "na", 3), ("Calgary", 51.045, -114.072, "na", 1),
    ("Edmonton", 53.546, -113.494, "na", 1),
    ("Ottawa", 45.421, -75.697, "na", 1), ("Winnipeg", 49.895, -97.138, "na", 1),
    ("Quebec City", 46.813, -71.208, "na", 1),
    ("Halifax", 44.649, -63.576, "na", 1), ("Mexico City", 19.433, -99.133, "na", 22),
    ("Guadalajara", 20.659, -103.350, "na", 5),
    ("Monterrey", 25.687, -100.316, "na", 5), ("Puebla", 19.041, -98.206, "na", 3),
    ("Tijuana", 32.515, -117.038, "na", 2),
    ("Merida", 20.967, -89.592, "na", 1), ("Guatemala City", 14.634, -90.507, "na", 3),
    ("San Salvador", 13.693, -89.218, "na", 1),
    ("Tegucigalpa", 14.072, -87.192, "na", 1), ("Managua", 12.114, -86.236, "na", 1),
    ("San Jose CR", 9.928, -84.091, "na", 1),
    ("Panama City", 8.983, -79.520, "na", 2), ("Havana", 23.113, -82.366, "na", 2),
    ("Santo Domingo", 18.486, -69.931, "na", 3),
    ("San Juan", 18.466, -66.106, "na", 2), ("Kingston", 17.971, -76.793, "na", 1),
    # South America
    ("Sao Paulo", -23.551, -46.633, "sa", 22), ("Rio de Janeiro", -22.907, -43.173, "sa", 13),
    ("Belo Horizonte", -19.917, -43.935, "sa", 6),
    ("Brasilia", -15.794, -47.882, "sa", 4), ("Salvador", -12.978, -38.502, "sa", 4),
    ("Fortaleza", -3.732, -38.527, "sa", 4),
    ("Recife", -8.048, -34.877, "sa", 4), ("Porto Alegre", -30.035, -51.218, "sa", 4),
    ("Curitiba", -25.429, -49.271, "sa", 3),
    ("Manaus", -3.119, -60.022, "sa", 2), ("Belem", -1.456, -48.490, "sa", 2), ("Goiania", -16.686, -49.265, "sa", 2),
    ("Buenos Aires", -34.604, -58.382, "sa", 15), ("Cordoba", -31.420, -64.188, "sa", 2),
    ("Rosario", -32.947, -60.639, "sa", 1),
    ("Mendoza", -32.889, -68.846, "sa", 1), ("Santiago", -33.449, -70.669, "sa", 7),
    ("Valparaiso", -33.047, -71.613, "sa", 1),
    ("Lima", -12.046, -77.043, "sa", 11), ("Arequipa", -16.409, -71.537, "sa", 1),
    ("Bogota", 4.711, -74.072, "sa", 11),
    ("Medellin", 6.244, -75.581, "sa", 4), ("Cali", 3.452, -76.532, "sa", 3),
    ("Barranquilla", 10.964, -74.796, "sa", 2),
    ("Caracas", 10.481, -66.904, "sa", 3), ("Maracaibo", 10.642, -71.612, "sa", 2),
    ("Quito", -0.181, -78.468, "sa", 3),
    ("Guayaquil", -2.171, -79.922, "sa", 3), ("La Paz", -16.490, -68.119, "sa", 2),
    ("Santa Cruz", -17.814, -63.156, "sa", 2),
    ("Asuncion", -25.264, -57.576, "sa", 2), ("Montevideo", -34.901, -56.164, "sa", 2),
    # Africa
    ("Lagos", 6.524, 3.379, "af", 15), ("Abuja", 9.076, 7.399, "af", 4), ("Kano", 12.002, 8.592, "af", 4),
    ("Cairo", 30.044, 31.236, "af", 21), ("Alexandria", 31.200, 29.919, "af", 5),
    ("Kinshasa", -4.441, 15.266, "af", 15),
    ("Johannesburg", -26.204, 28.047, "af", 10), ("Cape Town", -33.925, 18.424, "af", 5),
    ("Durban", -29.858, 31.022, "af", 4),
    ("Pretoria", -25.747, 28.229, "af", 3), ("Nairobi", -1.292, 36.822, "af", 5),
    ("Mombasa", -4.043, 39.668, "af", 1),
    ("Addis Ababa", 9.030, 38.740, "af", 5), ("Dar es Salaam", -6.792, 39.208, "af", 7),
    ("Kampala", 0.348, 32.583, "af", 3),
    ("Kigali", -1.944, 30.062, "af", 1), ("Luanda", -8.839, 13.289, "af", 9), ("Accra", 5.604, -0.187, "af", 4),
    ("Kumasi", 6.688, -1.624, "af", 3), ("Abidjan", 5.360, -4.008, "af", 5), ("Dakar", 14.716, -17.467, "af", 3),
    ("Bamako", 12.639, -8.003, "af", 3), ("Ouagadougou", 12.371, -1.520, "af", 3),
    ("Casablanca", 33.573, -7.590, "af", 4),
    ("Rabat", 34.020, -6.841, "af", 2), ("Marrakesh", 31.629, -7.981, "af", 1), ("Algiers", 36.754, 3.059, "af", 3),
    ("Tunis", 36.806, 10.181, "af", 2), ("Tripoli", 32.887, 13.191, "af", 1), ("Khartoum", 15.501, 32.560, "af", 6),
    ("Lusaka", -15.387, 28.323, "af", 3), ("Harare", -17.825, 31.034, "af", 2), ("Maputo", -25.969, 32.573, "af", 2),
    ("Antananarivo", -18.879, 47.508, "af", 3), ("Douala", 4.051, 9.768, "af", 3),
    ("Yaounde", 3.848, 11.502, "af", 3),
    ("Port Louis", -20.161, 57.499, "af", 1), ("Windhoek", -22.560, 17.066, "af", 1),
    ("Gaborone", -24.628, 25.923, "af", 1),
    # Middle East
    ("Dubai", 25.205, 55.271, "me", 4), ("Abu Dhabi", 24.454, 54.377, "me", 2), ("Doha", 25.286, 51.531, "me", 2),
    ("Riyadh", 24.713, 46.675, "me", 8), ("Jeddah", 21.486, 39.193, "me", 5), ("Dammam", 26.420, 50.089, "me", 2),
    ("Kuwait City", 29.376, 47.977, "me", 3), ("Manama", 26.229, 50.586, "me", 1),
    ("Muscat", 23.588, 58.383, "me", 2),
    ("Tel Aviv", 32.085, 34.782, "me", 4), ("Jerusalem", 31.768, 35.214, "me", 1), ("Amman", 31.954, 35.911, "me", 4),
    ("Beirut", 33.894, 35.502, "me", 2), ("Baghdad", 33.315, 44.366, "me", 8), ("Tehran", 35.689, 51.389, "me", 9),
    ("Mashhad", 36.297, 59.606, "me", 3), ("Isfahan", 32.655, 51.668, "me", 2),
    # Asia
    ("Tokyo", 35.676, 139.650, "as", 37), ("Osaka", 34.694, 135.502, "as", 19), ("Nagoya", 35.181, 136.906, "as", 9),
    ("Fukuoka", 33.590, 130.402, "as", 5), ("Sapporo", 43.062, 141.354, "as", 2),
    ("Sendai", 38.268, 140.870, "as", 2),
    ("Seoul", 37.567, 126.978, "as", 25), ("Busan", 35.180, 129.076, "as", 3), ("Incheon", 37.456, 126.705, "as", 3),
    ("Beijing", 39.904, 116.407, "as", 21), ("Shanghai", 31.230, 121.474, "as", 27),
    ("Guangzhou", 23.129, 113.264, "as", 18),
    ("Shenzhen", 22.543, 114.058, "as", 17), ("Chengdu", 30.573, 104.066, "as", 16),
    ("Chongqing", 29.563, 106.551, "as", 16),
    ("Wuhan", 30.593, 114.305, "as", 11), ("Xi'an", 34.342, 108.940, "as", 12),
    ("Hangzhou", 30.274, 120.155, "as", 12),
    ("Nanjing", 32.060, 118.797, "as", 9), ("Tianjin", 39.343, 117.362, "as", 13),
    ("Shenyang", 41.805, 123.431, "as", 8),
    ("Harbin", 45.803, 126.535, "as", 6), ("Qingdao", 36.067, 120.383, "as", 6), ("Dalian", 38.914, 121.615, "as", 6),
    ("Zhengzhou", 34.747, 113.625, "as", 10), ("Changsha", 28.228, 112.939, "as", 8),
    ("Kunming", 24.880, 102.833, "as", 7),
    ("Xiamen", 24.480, 118.089, "as", 5), ("Hong Kong", 22.320, 114.169, "as", 7),
    ("Macau", 22.199, 113.544, "as", 1),
    ("Taipei", 25.033, 121.565, "as", 7), ("Kaohsiung", 22.627, 120.301, "as", 3),
    ("Ulaanbaatar", 47.886, 106.906, "as", 2),
    ("Mumbai", 19.076, 72.878, "as", 21), ("Delhi", 28.704, 77.102, "as", 32),
    ("Bangalore", 12.972, 77.595, "as", 13),
    ("Hyderabad", 17.385, 78.487, "as", 10), ("Chennai", 13.083, 80.271, "as", 11),
    ("Kolkata", 22.573, 88.364, "as", 15),
    ("Pune", 18.520, 73.857, "as", 7), ("Ahmedabad", 23.023, 72.571, "as", 8), ("Jaipur", 26.912, 75.787, "as", 4),
    ("Lucknow", 26.847, 80.947, "as", 4), ("Kochi", 9.931, 76.267, "as", 2), ("Nagpur", 21.146, 79.088, "as", 3),
    ("Karachi", 24.861, 67.010, "as", 16), ("Lahore", 31.549, 74.344, "as", 13),
    ("Islamabad", 33.684, 73.048, "as", 2),
    ("Dhaka", 23.811, 90.413, "as", 22), ("Chittagong", 22.357, 91.783, "as", 5),
    ("Kathmandu", 27.717, 85.324, "as", 3),
    ("Colombo", 6.927, 79.861, "as", 2), ("Kabul", 34.555, 69.207, "as", 4), ("Tashkent", 41.300, 69.240, "as", 3),
    ("Almaty", 43.222, 76.851, "as", 2), ("Astana", 51.169, 71.449, "as", 1), ("Bishkek", 42.875, 74.570, "as", 1),
    ("Novosibirsk", 55.008, 82.935, "as", 2), ("Yekaterinburg", 56.839, 60.606, "as", 2),
    ("Vladivostok", 43.116, 131.886, "as", 1),
    ("Bangkok", 13.756, 100.502, "as", 11), ("Chiang Mai", 18.788, 98.985, "as", 1),
    ("Ho Chi Minh City", 10.823, 106.630, "as", 9),
    ("Hanoi", 21.028, 105.834, "as", 8), ("Da Nang", 16.054, 108.202, "as", 1),
    ("Phnom Penh", 11.556, 104.928, "as", 2),
    ("Vientiane", 17.975, 102.633, "as", 1), ("Yangon", 16.841, 96.173, "as", 5),
    ("Kuala Lumpur", 3.139, 101.687, "as", 8),
    ("Penang", 5.414, 100.329, "as", 2), ("Singapore", 1.352, 103.820, "as", 6),
    ("Jakarta", -6.208, 106.846, "as", 34),
    ("Surabaya", -7.257, 112.752, "as", 3), ("Bandung", -6.917, 107.619, "as", 3), ("Medan", 3.595, 98.672, "as", 3),
    ("Makassar", -5.148, 119.432, "as", 2), ("Denpasar", -8.650, 115.217, "as", 1),
    ("Manila", 14.600, 120.984, "as", 14),
    ("Cebu", 10.316, 123.885, "as", 3), ("Davao", 7.190, 125.455, "as", 2),
    # Oceania
    ("Sydney", -33.869, 151.209, "oc", 5), ("Melbourne", -37.814, 144.963, "oc", 5),
    ("Brisbane", -27.470, 153.026, "oc", 3),
    ("Perth", -31.951, 115.861, "oc", 2), ("Adelaide", -34.929, 138.601, "oc", 1),
    ("Canberra", -35.281, 149.130, "oc", 1),
    ("Hobart", -42.882, 147.327, "oc", 1), ("Darwin", -12.463, 130.842, "oc", 1),
    ("Gold Coast", -28.017, 153.400, "oc", 1),
    ("Auckland", -36.849, 174.763, "oc", 2), ("Wellington", -41.287, 174.776, "oc", 1),
    ("Christchurch", -43.532, 172.637, "oc", 1),
    ("Suva", -18.142, 178.442, "oc", 1), ("Port Moresby", -9.443, 147.180, "oc", 1),
    ("Noumea", -22.276, 166.458, "oc", 1),
]

# Sites stand in the 300 most populous of these cities; clients come from all of them.
SITE_CITIES = sorted(CITIES, key=lambda city: -city[4])[:300]

# Hardware classes: (measured prefill tokens/s, lone-sequence decode tokens/s, KV blocks)
HARDWARE = [(20_000.0, 120.0, 40_000), (30_000.0, 150.0, 60_000), (40_000.0, 170.0, 100_000)]
SYSTEM_PROMPTS = [list(range(100_000 + 1000 * i, 100_000 + 1000 * i + 512)) for i in range(24)]


def site_doc(index: int, city: tuple, rng: random.Random, now: float) -> dict:
    name, lat, lon, region, _weight = city
    prefill_rate, lone_decode_rate, blocks = HARDWARE[index % len(HARDWARE)]
    role = "prefill" if index % 10 == 3 else "decode" if index % 10 == 7 else "both"
    num_running = rng.choice([0, 0, 1, 2, 2, 4, 4, 8, 8, 16, 32])
    context = rng.randint(200, 3000)
    blocks_used = min(blocks - 100, num_running * math.ceil(context / BLOCK_SIZE) + rng.randint(0, blocks // 10))
    fixed = CostModel().decode_step_fixed
    # The rate an engine of this class measures under that load.
    decode_rate = num_running * lone_decode_rate * (fixed + 1) / (fixed + max(1, num_running)) or lone_decode_rate
    cached = rng.sample(SYSTEM_PROMPTS, rng.randint(0, 6))
    hashes = [f"{h:016x}" for prompt in cached for h in prefix_hashes(prompt, BLOCK_SIZE)]
    # running sequences hold the prompts they opened with, one each (drawn without the rng: the same fleet)
    num_held = sum(len(prefix_hashes(prompt, BLOCK_SIZE)) for prompt in cached[:num_running])
    return {
        "name": name, "region": region, "country": None, "lat": lat, "lon": lon,
        "grpc_address": f"{name.lower().replace(' ', '-')}.sites.example:50051", "state": "active",
        "roles": ["prefill", "decode"], "models": [{"model": MODEL, "role": role}], "alive": True,
        "heartbeat_age_s": rng.uniform(0.1, 3.0),
        "capacity": {
            "kv_blocks_total": blocks, "kv_blocks_free": blocks - blocks_used, "block_size": BLOCK_SIZE,
            "num_running": num_running, "num_waiting": 0,
            "inflight_prefill_tokens": rng.choice([0, 0, 0, 0, 500, 1000, 4000]),
            "inflight_decode_tokens": num_running * rng.randint(1, 400),
            "prefill_tokens_per_s": prefill_rate * rng.uniform(0.8, 1.2), "decode_tokens_per_s": decode_rate,
            # The load the rate was measured under (an idle site: its last request, alone).
            "decode_batch_size": float(max(1, num_running)), "decode_kv_tokens": float(max(1, num_running) * context),
            "draining": False,
            "prefix_cache_summary": {"block_size": BLOCK_SIZE, "hashes": hashes, "num_held": num_held},
            "reported_at": now - 1.0,
        },
    }


def snapshot_doc(rng: random.Random, now: float) -> dict:
    sites = [site_doc(i, city, rng, now) for i, city in enumerate(SITE_CITIES)]
    links = []
    by_region: dict[str, list[dict]] = {}
    for site in sites:
        by_region.setdefault(site["region"], []).append(site)
    for members in by_region.values():
        for _ in range(len(members) * 2):
            src, dst = rng.sample(members, 2)
            rtt = rtt_ms_between(src["lat"], src["lon"], dst["lat"], dst["lon"]) * rng.uniform(0.9, 1.6)
            links.append({"src": src["name"], "dst": dst["name"], "rtt_ms": rtt,
                          "bandwidth_mbps": rng.choice([1000.0, 10_000.0, 25_000.0, 100_000.0]),
                          "measured_at": now - rng.uniform(0, 600)})
    return {"version": str(now), "generated_at": now, "sites": sites, "links": links}


def client_request(rng: random.Random, weights: list[int]) -> PlacementRequest:
    _name, lat, lon, _region, _w = rng.choices(CITIES, weights)[0]
    lat, lon = lat + rng.uniform(-0.4, 0.4), lon + rng.uniform(-0.4, 0.4)
    length = rng.randint(50, 4000)
    if rng.random() < 0.5:
        system = rng.choice(SYSTEM_PROMPTS)
        prompt = system + [rng.randrange(32_000) for _ in range(max(0, length - len(system)))]
    else:
        prompt = [rng.randrange(32_000) for _ in range(length)]
    return PlacementRequest(MODEL, prompt, rng.randint(16, 512), lat, lon, kv_bytes_per_token=KV_BYTES_PER_TOKEN)


def nearest_site(request: PlacementRequest, snapshot, cost: CostModel):
    """The oracle: the nearest live site serving the model in the decode role with room for the
    request, by distance alone (the best any placement could do on round trip)."""
    blocks = math.ceil((len(request.prompt_ids) + min(request.max_tokens, cost.expected_output_tokens)) / BLOCK_SIZE)
    viable = [site for site in snapshot.sites
              if is_live(site, cost) and site.serves(MODEL, "decode") and site.capacity.kv_blocks_free >= blocks]
    return min(viable, key=lambda site: rtt_ms_between(request.client_lat, request.client_lon, site.lat, site.lon))


def score_alone_ms(request: PlacementRequest, snapshot, site, cost: CostModel) -> float | None:
    """The cost model's score for the request on that one site (colocated), as rank() computes it."""
    ranked = rank(Snapshot(snapshot.version, snapshot.generated_at, [site], snapshot.links), request, cost)
    return ranked[0].score_ms if ranked else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--placements", type=int, default=100_000)
    parser.add_argument("--refresh-every", type=int, default=1000)
    parser.add_argument("--oracle-sample", type=int, default=5000, help="placements compared with the oracle")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    cost = CostModel()
    weights = [city[4] for city in CITIES]
    print(f"{len(SITE_CITIES)} sites, {args.placements} placements, a fresh snapshot every {args.refresh_every}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    wall_ns, cpu_ns, first_wall_ns, rtt_chosen, rtt_oracle, score_gain = [], [], [], [], [], []
    num_split = num_nearest = num_none = 0
    snapshot, fresh = None, False
    for i in range(args.placements):
        if i % args.refresh_every == 0:
            snapshot, fresh = parse_snapshot(snapshot_doc(rng, time.time())), True
        if i and i % 10_000 == 0:
            print(f"  {i} placements, wall p50 so far {statistics.median(wall_ns) / 1000:.0f} us", flush=True)
        request = client_request(rng, weights)
        cpu_started, started = time.process_time_ns(), time.perf_counter_ns()
        ranked = rank(snapshot, request, cost)
        elapsed, cpu = time.perf_counter_ns() - started, time.process_time_ns() - cpu_started
        if fresh:
            first_wall_ns.append(elapsed)  # this call also built the snapshot's arrays
        else:
            wall_ns.append(elapsed)
            cpu_ns.append(cpu)
        fresh = False
        if not ranked:
            num_none += 1
            continue
        best = ranked[0]
        num_split += not best.colocated
        if i % max(1, args.placements // args.oracle_sample) == 0:
            decode = best.decode_site
            chosen = rtt_ms_between(request.client_lat, request.client_lon, decode.lat, decode.lon)
            nearest = nearest_site(request, snapshot, cost)
            oracle = rtt_ms_between(request.client_lat, request.client_lon, nearest.lat, nearest.lon)
            nearest_score = score_alone_ms(request, snapshot, nearest, cost)
            if nearest_score is not None:
                score_gain.append(nearest_score - best.score_ms)
            rtt_chosen.append(chosen)
            rtt_oracle.append(oracle)
            num_nearest += chosen <= oracle + 1e-9
    placed = args.placements - num_none
    print(f"rank() per placement, wall: p50 {_pct(wall_ns, 0.5):.0f} us, p99 {_pct(wall_ns, 0.99):.0f} us, "
          f"max {max(wall_ns) / 1000:.0f} us ({len(wall_ns)} calls)")
    print(f"rank() per placement, CPU time of this process: p50 {_pct(cpu_ns, 0.5):.0f} us, "
          f"p99 {_pct(cpu_ns, 0.99):.0f} us")
    print(f"first call after each refresh (builds the snapshot's arrays): wall median "
          f"{statistics.median(first_wall_ns) / 1000:.0f} us, max {max(first_wall_ns) / 1000:.0f} us "
          f"({len(first_wall_ns)} calls)")
    print(f"client RTT to the decode site (sample of {len(rtt_chosen)}): chosen mean "
          f"{statistics.fmean(rtt_chosen):.1f} ms, nearest-site oracle mean {statistics.fmean(rtt_oracle):.1f} ms; "
          f"the nearest site chosen {100 * num_nearest / len(rtt_chosen):.0f}% of the time; the cost model "
          f"scores the chosen pair {statistics.fmean(score_gain):.0f} ms "
          f"(median {statistics.median(score_gain):.0f} ms) better than the nearest site alone")
    print(f"placed {placed}, no site {num_none}; split {100 * num_split / placed:.1f}%, "
          f"colocated {100 * (placed - num_split) / placed:.1f}%; load average {os.getloadavg()[0]:.2f}")


def _pct(values_ns: list[int], q: float) -> float:
    ordered = sorted(values_ns)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000


if __name__ == "__main__":
    main()
