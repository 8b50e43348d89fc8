"""Hand-made layouts of the relay tests (plain data: the GPU machine imports it too)."""

# Rank 4 alone needs "big" (four source shards), every destination rank needs "rep": rank 4's
# NIC would carry most of the domain's ingress, so ranks 5-7 receive shards of "big" that
# they do not need and forward them.
RELAY_SPEC = {
    "domains": [0, 0, 0, 0, 1, 1, 1, 1],
    "tensors": [
        {"name": "big", "shape": [64, 32], "dtype": "float32",
         "source": {"mesh": [0, 1, 2, 3], "placements": ["S(0)"]},
         "destination": {"mesh": [4], "placements": ["R"]}},
        {"name": "rep", "shape": [16, 9], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(0)"]},
         "destination": {"mesh": [4, 5, 6, 7], "placements": ["R"]}},
        {"name": "split", "shape": [12, 10], "dtype": "int8",
         "source": {"mesh": [3], "placements": ["R"]},
         "destination": {"mesh": [[5, 6]], "placements": ["R", "S(1)"]}},
    ],
}
