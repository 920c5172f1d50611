"""The node's choice between a whole model download and a delta (node/modelpath.py)."""

from __future__ import annotations

from gpuflex.node.modelpath import RETRY_FIRST, ModelPath

MB = 1_200_000


def run(path: ModelPath, rounds: int, cost: dict[str, float]) -> list[str]:
    """``rounds`` choices after round 0, each way taking ``cost[way]`` seconds for a 1.2 MB model."""
    out = []
    for _ in range(rounds):
        way = path.choose()
        path.record(way, cost[way], MB)
        out.append(way)
    return out


def round_zero(whole_s: float) -> ModelPath:
    path = ModelPath()
    path.record("whole", whole_s, MB)  # round 0: the whole model, with the chunks
    return path


def test_untimed_the_delta_comes_first() -> None:
    assert ModelPath().choose() == "delta"
    assert round_zero(0.004).choose() == "delta"


def test_on_a_fast_link_the_whole_model_wins_and_the_delta_is_tried_ever_more_rarely() -> None:
    # loopback: round 0's whole download shared the link with the chunks (37 ms), alone it takes 4
    path = round_zero(0.037)
    ways = run(path, 40, {"delta": 0.027, "whole": 0.004})
    first_whole = ways.index("whole")
    assert ways[:first_whole] == ["delta"] * first_whole and first_whole == RETRY_FIRST, ways
    retried = [i for i, w in enumerate(ways) if w == "delta" and i > first_whole]
    gaps = [b - a for a, b in zip([first_whole - 1, *retried], retried, strict=False)]
    assert gaps == [RETRY_FIRST * 2 ** k + 1 for k in range(len(gaps))] and len(gaps) >= 2, (ways, gaps)


def test_on_a_home_line_the_delta_wins_and_the_whole_model_is_tried_ever_more_rarely() -> None:
    # 20 Mbit/s: the whole 1.2 MB model in 0.48 s, the 0.7 MB delta in 0.28 s plus 30 ms of work
    ways = run(round_zero(0.6), 40, {"delta": 0.31, "whole": 0.48})
    wholes = [i for i, w in enumerate(ways) if w == "whole"]
    assert wholes == [RETRY_FIRST, RETRY_FIRST + 2 * RETRY_FIRST + 1, RETRY_FIRST + 6 * RETRY_FIRST + 2], ways


def test_a_link_that_slows_down_moves_the_choice_to_the_delta_and_back() -> None:
    path = round_zero(0.004)
    run(path, 1, {"delta": 0.027, "whole": 0.004})
    assert path.choose() == "whole"
    path.record("whole", 0.48, MB)  # the link drops to home speed
    assert path.choose() == "delta"
    path.record("whole", 0.004, MB)  # and comes back
    assert path.choose() == "whole"
