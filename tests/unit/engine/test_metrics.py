"""The engine's metrics page: weight-update series exist at 0 before the first update."""

from rlmesh.engine.metrics import EngineMetrics


def test_weight_update_series_exist_before_any_update():
    metrics = EngineMetrics()
    for source in ("distributed", "disk"):
        for outcome in ("ok", "failed"):
            labels = {"source": source, "outcome": outcome}
            assert metrics.registry.get_sample_value("rlmesh_engine_weight_updates_total", labels) == 0
