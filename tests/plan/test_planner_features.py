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
}
# Where a feature is still named outside its own file, and why: tp shards every other
# feature's tensors and rank_model builds the rank's tp/ep contexts; pp appears where units or
# work are counted per stage; the others name the dp_cp / edp groups their terms run over.
MOST_FILES = {"tp/sp": 5, "pipeline/vpp": 5, "recompute": 4, "cp": 4, "zero/dp": 3, "moe/ep": 3}


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
