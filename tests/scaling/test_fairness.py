"""Users in traces and the per-user report (issue 28): fair shares, Jain's index and p99 waits
worked out by hand, the user column and mapping, the quota options of the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nbos.cli.main import main
from nbos.core.errors import ConfigError, ScalingError
from nbos.scaling import (
    Cell,
    FairShare,
    Session,
    SimConfig,
    Trace,
    UserCell,
    jain_index,
    simulate,
)
from nbos.scaling.fairness import fair_gpu_seconds, percentile, user_figures, water_fill
from nbos.scaling.timings import Timings
from nbos.scaling.trace import dump_csv, parse_csv, parse_json, with_users

# Alice runs two 1-GPU cells over [0, 100); bob's, ready at 0 too, waits for them and
# runs over [100, 200).
CELLS = (
    UserCell("alice", 1, 0.0, 0.0, 100.0),
    UserCell("alice", 1, 0.0, 0.0, 100.0),
    UserCell("bob", 1, 0.0, 100.0, 200.0),
)
TWO_USERS = Trace(
    (
        Session("s1", 0, 300, 1, user="alice"),
        Session("s2", 0, 300, 1, user="alice"),
        Session("s3", 0, 300, 1, user="bob"),
    )
)


def test_jain_index_of_the_hand_example_with_equal_quotas() -> None:
    # Over [0, 100) the 2 GPUs held are shared 1 and 1 (alice wants 2, bob 1); over
    # [100, 200) bob alone wants, and holds, 1. Fair: alice 100 GPU-s, bob 200; used:
    # alice 200, bob 100. Ratios 2 and 1/2: (2.5)^2 / (2 * (4 + 1/4)) = 6.25 / 8.5.
    users = user_figures(TWO_USERS, CELLS, FairShare({"alice": 1, "bob": 1}))
    by = {u.user: u for u in users}
    assert by["alice"].fair_gpu_hours * 3600 == pytest.approx(100)
    assert by["bob"].fair_gpu_hours * 3600 == pytest.approx(200)
    assert (by["alice"].gpu_hours * 3600, by["bob"].gpu_hours * 3600) == (200, 100)
    assert jain_index([2.0, 0.5]) == pytest.approx(6.25 / 8.5)
    assert (by["alice"].wait_p99, by["bob"].wait_p99) == (0.0, 100.0)
    assert (by["alice"].quota, by["alice"].cells, by["bob"].cells) == (1, 2, 1)


def test_quotas_weigh_the_fair_shares() -> None:
    # Alice's quota 3 to bob's 1: over [0, 100) the 2 GPUs split 1.5 / 0.5, then bob 1:
    # fair 150 and 150; ratios 4/3 and 2/3: 2^2 / (2 * (16/9 + 4/9)) = 0.9.
    fair = fair_gpu_seconds(CELLS, {"alice": 3, "bob": 1})
    assert fair == pytest.approx({"alice": 150.0, "bob": 150.0})
    assert jain_index([200 / 150, 100 / 150]) == pytest.approx(0.9)


def test_without_quotas_users_weigh_alike_and_zero_quotas_take_leftovers() -> None:
    users = user_figures(TWO_USERS, CELLS, None)
    assert [u.quota for u in users] == [None, None]
    assert sum(u.fair_gpu_hours for u in users) == pytest.approx(300 / 3600)
    assert water_fill(3, {"a": 2, "z": 5}, {"a": 1, "z": 0}) == {"a": 2.0, "z": 1.0}
    assert water_fill(2, {"a": 5, "b": 5}, {"a": 1, "b": 3}) == {"a": 0.5, "b": 1.5}


def test_jain_index_bounds_and_percentile() -> None:
    assert jain_index([1.0, 1.0, 1.0]) == 1.0
    assert jain_index([3.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([]) == 1.0
    # 11 waits 0, 10, ..., 100: rank 0.99 * 10 = 9.9, between 90 and 100.
    assert percentile([float(x) for x in range(0, 101, 10)], 0.99) == pytest.approx(99.0)


def test_a_trace_without_users_makes_each_session_its_own_user() -> None:
    # The sessions start long before their cells, so all kernels are placed by then.
    trace = Trace(tuple(Session(f"s{i}", 0, 2000, 1, (Cell(1000, 5),)) for i in range(3)))
    assert not trace.names_users
    config = SimConfig(hosts=2, gpus_per_host=1, replicas_per_kernel=2, autoscaler=None)
    instant = Timings(host_startup=0, migration_time=0, gpu_commit=0, kernel_start=0)
    result = simulate(trace, config.timed(instant))
    assert [u.user for u in result.users] == ["s0", "s1", "s2"]
    # Two GPUs: the third cell waits 5 s for one of the first two.
    assert sorted(u.wait_p99 for u in result.users) == [0.0, 0.0, 5.0]


def test_user_column_mapping_and_validation() -> None:
    trace = parse_csv(
        "session,event,time,duration,gpus,user\n"
        "a,start,0,,1,alice\na,cell,1,2,,\na,stop,10,,,\nb,start,0,,1,\nb,stop,5,,,\n"
    )
    assert [(s.id, s.user, s.owner) for s in trace.sessions] == [
        ("a", "alice", "alice"),
        ("b", None, "b"),
    ]
    assert parse_csv(dump_csv(trace)) == trace
    assert (
        parse_json(b'{"sessions": [{"id": "x", "start": 0, "stop": 1, "gpus": 0, "user": "u"}]}')
        .sessions[0]
        .user
        == "u"
    )
    mapped = with_users(trace, {"b": "bob"})
    assert [s.owner for s in mapped.sessions] == ["alice", "bob"]
    with pytest.raises(ScalingError, match="does not hold"):
        with_users(trace, {"nope": "bob"})
    with pytest.raises(ScalingError, match="non-empty"):
        with_users(trace, {"a": ""})
    with pytest.raises(ScalingError, match="empty user"):
        parse_json(b'{"sessions": [{"id": "x", "start": 0, "stop": 1, "gpus": 0, "user": ""}]}')


def test_cli_takes_quotas_and_a_session_mapping(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "users.json").write_text(json.dumps({"s000": "alice", "s001": "alice"}))
    base = ["simulate", "--synthetic", "3", "--hours", "2", "--mode", "nbos", "--no-autoscale"]
    argv = [*base, "--session-users", str(tmp_path / "users.json"), "--quota", "alice=2"]
    assert main([*argv, "--default-quota", "1"]) == 0
    out = capsys.readouterr().out
    assert "nbos: per user (Jain's fairness index" in out
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.startswith(("alice", "s002"))
    }
    assert rows["alice"][1] == "2" and rows["s002"][1] == "1"
    assert main([*argv, "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [u["user"] for u in row["users"]] == ["alice", "s002"]
    assert 0 < row["jain_index"] <= 1
    for bad in (["--quota", "alice"], ["--quota", "alice=-1"], ["--default-quota", "-1"]):
        assert main([*base, *bad]) == 1
        assert "bad config value" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main([*base, "--session-users", str(tmp_path / "bad.json")]) == 1
    assert "--session-users" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        FairShare({"alice": -1})
