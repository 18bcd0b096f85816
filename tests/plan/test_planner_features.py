"""The planner stays organised by feature: each feature's terms live in its own file, and no
feature spreads into more planner files than it does today (tools/planner_features.py)."""

import planner_features

OWN_FILE = {
    "tp/sp": "dense.py",
    "pipeline/vpp": "pipeline.py",
    "recompute": "recompute.py",
    "cp": "context_parallel.py",
    "zero/dp": "data_parallel.py",
    "moe/ep": "moe.py",
    "grad compression": "grad_compression.py",
}
# Where a feature is still named outside its own file, and why (each is the feature acting on
# another one's tensors, not a term of its own computed elsewhere): tp shards every feature's
# tensors (cp's gathered K/V, the experts and their sp collectives) and rank_model builds the
# rank's tp/ep contexts; ZeRO shards and reduces the expert buckets over their own group
# (data_parallel); the experts' balancing counts are summed over cp (moe); Korthikanti et al.'s
# reference formula has one case per recompute policy (dense). Group names, the rank's cache
# keys and per-replica counts are the layout's (layout.py, from the runtime's grid).
MOST_FILES = {
    "tp/sp": 4,
    "pipeline/vpp": 1,
    "recompute": 2,
    "cp": 2,
    "zero/dp": 1,
    "moe/ep": 3,
    "grad compression": 1,
}


def test_each_feature_lives_in_its_own_file_and_spreads_no_further():
    table = planner_features.feature_files(planner_features.plan_files(None))
    assert set(table) == set(OWN_FILE)
    for feature, (files, _machinery) in table.items():
        assert OWN_FILE[feature] in files, f"{feature}: {OWN_FILE[feature]} no longer names it"
        assert len(files) <= MOST_FILES[feature], (
            f"{feature} is now named in {len(files)} planner files ({', '.join(files)}); "
            f"its terms belong in {OWN_FILE[feature]}, added up by estimate/step_time"
        )


def test_the_table_sees_a_feature_named_in_another_file():
    files = planner_features.plan_files(None)
    files["dense.py"] += "\ndef leak(layout):\n    return layout.zero_stage\n"
    zero_files, _ = planner_features.feature_files(files)["zero/dp"]
    assert "dense.py" in zero_files
    files["dense.py"] += "\n# layout.vpp in a comment does not count\n"
    assert "dense.py" not in planner_features.feature_files(files)["pipeline/vpp"][0]
