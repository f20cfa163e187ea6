"""The cost model under figures a client or a server reports that no real run gives: one release whose
`prompt_ms` is vanishingly small (ReleaseBody takes any value in [0, 1e9)) or a transfer timed at almost
nothing must not leave an infinite figure behind. An exponentially weighted mean that once holds inf holds
it for ever: every prefill would then cost 0 s, so no restore would ever be worth it (plan.py `worth`), no
prompt point cheap (`point_cheap`) and every save "recompute cheaper", on that server until kvsidecar restarts."""

from __future__ import annotations

import math

from kvsidecar.api.bodies import ReleaseBody
from kvsidecar.coordinator.costs import CostModel
from kvsidecar.coordinator.plan import point_cheap, worth


def test_a_vanishing_prompt_ms_leaves_the_prefill_figure_finite() -> None:
    body = ReleaseBody.model_validate_json('{"status": "ok", "prompt_tokens": 5, "prompt_ms": 1e-320}')
    assert body.prompt_ms == 1e-320  # the API takes it
    costs = CostModel()
    costs.observe_transfer("s", kind="save", nbytes=1 << 20, tokens=1000, server_ms=10.0, measured_ms=10.0)
    costs.observe_transfer("s", kind="restore", nbytes=1 << 20, tokens=1000, server_ms=10.0, measured_ms=10.0)
    costs.observe_prefill("s", tokens=1000, ms=10_000.0)  # 100 tokens/s
    costs.observe_prefill("s", tokens=5, ms=body.prompt_ms)
    rate = costs.server("s").prefill_tokens_per_s.value
    assert rate is not None and math.isfinite(rate)
    f = costs.server("s").figures()
    assert worth(f, 3000, 3000)  # 30 s of prefill spared by a 3 MB read: still worth it
    assert point_cheap(f, 3000)


def test_a_transfer_timed_at_almost_nothing_leaves_the_bandwidths_finite() -> None:
    costs = CostModel()
    costs.observe_transfer("s", kind="restore", nbytes=1 << 20, tokens=1000, server_ms=10.0, measured_ms=10.0)
    costs.observe_transfer(
        "s", kind="restore", nbytes=1 << 20, tokens=1000, server_ms=1e-320, measured_ms=1.0
    )
    costs.observe_transfer("s", kind="save", nbytes=1 << 20, tokens=1000, server_ms=1e-320, measured_ms=1.0)
    live = costs.server("s")
    for value in (live.restore_bytes_per_s.value, live.kv_bytes_per_token.value):
        assert value is not None and math.isfinite(value)
    assert live.save_bytes_per_s.value is None or math.isfinite(live.save_bytes_per_s.value)
