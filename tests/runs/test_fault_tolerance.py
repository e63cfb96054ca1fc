"""Fault tolerance without a restart (issue 38), real processes on gloo: a torchft lighthouse and
replica groups of the real trainer on the debug model (fp32, fixed seed), each group its own
world (tests/helpers/replica_groups.py).

- Two groups of FSDP 2 equal a plain HSDP 2 x 2 run of the same global batch (every logged loss
  and grad norm within 1e-5), and end with bit-equal states; a whole-job restart resumes from the
  one checkpoint the first group of the quorum saved (the other group heals from it).
- kill -9 of one group at step k: the other goes on (steps continue, the shrink logged, nothing
  resumed from a checkpoint); the killed group started again heals from the live one, the two
  train together again and end with bit-equal weights and optimizer state.
- DiLoCo and local SGD (torchft's) over two groups equal a DiLoCo written in plain torch over
  the trainer.
- Below min_replica_size training waits, and goes on when the group is back; a group that stays
  away, and an unreachable lighthouse, end in one line.
- scripts/run_ft_local.sh starts a lighthouse and the groups.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import (
    EQUIVALENCE_ARGS,
    EQUIVALENCE_STEPS,
    REPO,
    assert_same_curve,
    free_port,
    run_env,
    run_mains,
    run_trainer_worker,
    timeout_scale,
    with_overrides,
)
from tests.helpers.replica_groups import REFERENCE, Group, lighthouse, run_python

pytest.importorskip("torchft")

GROUPS = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"]
# Global batch 8: 2 groups x FSDP 2 x local_batch_size 2, as HSDP 2 x 2 x 2.
FT_ARGS = with_overrides(EQUIVALENCE_ARGS, ["--training.local_batch_size", "2"], GROUPS)


def step_numbers(history: list[dict]) -> list[int]:
    return [h["step"] for h in history]


SAVED = EQUIVALENCE_STEPS  # the first start's last step, which it saves (3)
RESUMED_STEPS = SAVED + 2
# Constant lr after warmup: a run told to stop at step 3 follows the schedule of one told to run 5.
CONSTANT_LR = ["--lr_scheduler.decay_ratio", "0"]
CHECKPOINTS = ["--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", str(SAVED)]


# Layouts inside a group of two processes besides FSDP 2: global batch 8 as 2 groups x local_batch_size 4.
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]


@pytest.mark.slow
def test_two_groups_equal_hsdp_and_resume_after_a_whole_job_restart(tmp_path):
    """Two FSDP 2 groups, 3 steps, equal HSDP 2 x 2 and end bit-equal, and so do two groups of PP 2
    (HSDP x PP equals HSDP, tested apart); the first group of the FSDP quorum saved the step-3
    checkpoint. The whole job started again to step 5 as two groups of TP 2: group 0 resumes from it
    (at another layout), group 1 (which saved none) heals from group 0, and steps 4-5 are HSDP's
    too, the two groups bit-equal."""
    args = [*FT_ARGS, *CONSTANT_LR, *CHECKPOINTS, "--job.dump_folder", str(tmp_path / "ft")]
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(lighthouse(min_replicas=2))  # both groups in the first quorum
        results = [group.wait(180) for group in [Group(g, 2, args, tmp_path, address) for g in (0, 1)]]
        pp = with_overrides(FT_ARGS, CONSTANT_LR, PP2, ["--job.dump_folder", str(tmp_path / "pp2")])
        pp_address = stack.enter_context(lighthouse(min_replicas=2))
        pipelined = [Group(g, 2, pp, tmp_path, pp_address, "_pp2") for g in (0, 1)]
        longer = with_overrides(args, ["--training.steps", str(RESUMED_STEPS)], TP2)
        restarted = [Group(g, 2, longer, tmp_path, address, "_b") for g in (0, 1)]
        resumed = [group.wait(180) for group in restarted]
        pp_results = [group.wait(240) for group in pipelined]
    hsdp = run_trainer_worker(
        4,
        [
            *with_overrides(EQUIVALENCE_ARGS, ["--training.local_batch_size", "2"], CONSTANT_LR),
            "--training.steps",
            str(RESUMED_STEPS),
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--job.dump_folder",
            str(tmp_path / "hsdp"),
        ],
        tmp_path / "hsdp.json",
    )
    for g, result in enumerate(results):
        assert_same_curve(result["history"], hsdp["history"][:SAVED], f"replica group {g}")
        assert [h["quorum"] for h in result["history"]] == [2] * len(result["history"])
        assert [h["tokens_seen"] for h in result["history"]] == [h["tokens_seen"] for h in hsdp["history"][:SAVED]]
    assert results[0]["checksums"] == results[1]["checksums"]
    for g, result in enumerate(pp_results):
        assert_same_curve(result["history"], hsdp["history"][:SAVED], f"PP 2 replica group {g}")
    assert pp_results[0]["checksums"] == pp_results[1]["checksums"]
    assert (tmp_path / "ft" / "replica_0" / "checkpoint" / f"step-{SAVED}").is_dir()
    assert not (tmp_path / "ft" / "replica_1" / "checkpoint").exists() or not any(
        (tmp_path / "ft" / "replica_1" / "checkpoint").iterdir()
    )
    assert f"resumed at step {SAVED}" in restarted[0].text()
    assert f"step {SAVED + 1}: replica group 1 healed from a live group" in restarted[1].text()
    for g, result in enumerate(resumed):
        assert step_numbers(result["history"]) == list(range(SAVED + 1, RESUMED_STEPS + 1))
        for ours, ref in zip(result["history"], hsdp["history"][SAVED:]):
            for key in ("loss", "grad_norm"):
                assert ours[key] == pytest.approx(ref[key], rel=1e-5), f"resumed group {g} step {ref['step']} {key}"
    assert resumed[0]["checksums"] == resumed[1]["checksums"]


# The MoE cases: Qwen3-MoE equals HSDP here and trains DiLoCo below; DeepSeek-V3's groups are
# killed and healed in the min_replica_size test (its bit-equal end needs the summed counts too).
MOE_MODELS = {
    "qwen3_moe": ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"],
    "deepseek_v3": ["--model.name", "deepseek_v3"],
}


@pytest.mark.slow
def test_moe_groups_equal_hsdp(tmp_path):
    """Qwen3-MoE in two one-process groups equals HSDP 2 of the same global batch: every loss and
    grad norm, and the expert biases, which the groups balance on the token counts of every group
    (as HSDP sums them over its replicas); the groups end bit-equal, expert biases included."""
    args = with_overrides(EQUIVALENCE_ARGS, ["--training.local_batch_size", "4"], MOE_MODELS["qwen3_moe"])
    hsdp_args = [
        *args,
        "--job.dump_folder",
        str(tmp_path / "hsdp"),
        "--parallelism.data_parallel_replicate_degree",
        "2",
    ]
    with lighthouse(min_replicas=2) as address:
        ft_args = [*args, *GROUPS, "--job.dump_folder", str(tmp_path / "ft")]
        groups = [Group(g, 1, ft_args, tmp_path, address) for g in (0, 1)]
        hsdp_group = Group(0, 2, hsdp_args, tmp_path, address, "_hsdp")  # no fault tolerance: plain HSDP
        first, second, hsdp = (group.wait(240) for group in [*groups, hsdp_group])
    assert hsdp["biases"] and any(v for bias in hsdp["biases"].values() for v in bias)  # the biases moved
    for g, result in enumerate((first, second)):
        assert_same_curve(result["history"], hsdp["history"], f"replica group {g}")
        for layer, bias in hsdp["biases"].items():
            assert result["biases"][layer] == pytest.approx(bias, abs=1e-7), f"group {g} {layer}"
    assert first["checksums"] == second["checksums"]


KILL_STEPS, KILL_AT = 45, 5


@pytest.mark.slow
def test_kill_rejoin_heal(tmp_path):
    """kill -9 of one FSDP 2 group at step 5: the other goes on, saving every 10 steps alone; the
    killed group, started again from a copy of the survivor's step-10 checkpoint (as from shared
    storage), resumes there, then heals from the live group and says the resume was superseded;
    the two end bit-equal. Neither log holds torchft's traceback or access lines."""
    steps = [
        "--training.steps",
        str(KILL_STEPS),
        "--checkpoint.enable_checkpoint",
        "true",
        "--checkpoint.interval",
        "10",
    ]
    args = with_overrides(FT_ARGS, steps, ["--job.dump_folder", str(tmp_path / "ft")])
    with lighthouse(min_replicas=1) as address:
        groups = [Group(g, 2, args, tmp_path, address) for g in (0, 1)]
        try:
            for group in groups:
                group.wait_for(rf"^\S+ step +{KILL_AT} ", 120)
            # The group that started second healed from the first at its first step: kill that one,
            # so the survivor's history runs from step 1.
            victim = next((g for g in groups if "healed from a live group" in g.text()), groups[1])
            survivor = groups[1 - victim.replica]
            victim.kill()
            saved = tmp_path / "ft" / f"replica_{survivor.replica}" / "checkpoint" / "step-10"
            survivor.wait_for(r"^\S+ step +12 ", 120)
            assert (saved / "commit.json").exists()
            shutil.copytree(saved, tmp_path / "ft" / f"replica_{victim.replica}" / "checkpoint" / "step-10")
            rejoined = Group(victim.replica, 2, args, tmp_path, address, tag="_restarted")
            lived, back = survivor.wait(300), rejoined.wait(300)
        finally:
            for group in groups:
                group.stop()
    out = survivor.text()
    assert step_numbers(lived["history"]) == list(range(1, KILL_STEPS + 1))  # no step lost, none repeated
    assert "resumed at step" not in out
    shrink = re.search(r"step (\d+): quorum shrank to 1/2", out)
    assert shrink and int(shrink[1]) > KILL_AT, out[-3000:]
    grew = re.search(r"step (\d+): quorum grew to 2/2", out[shrink.end() :])
    assert grew, f"the restarted group did not rejoin before the survivor finished:\n{out[-3000:]}"
    healed = re.search(rf"step (\d+): replica group {victim.replica} healed from a live group", rejoined.text())
    assert healed and healed[1] == grew[1], rejoined.text()[-3000:]
    assert "resumed at step 10" in rejoined.text() and "the resume at step 10 is superseded" in rejoined.text()
    assert_own_lines_only(out)
    assert_own_lines_only(rejoined.text())
    first = int(healed[1])
    assert step_numbers(back["history"]) == list(range(first, KILL_STEPS + 1))
    # the end lines count what each start trained: the healed group from its heal on
    done = [re.search(r"done: ([\d,]+) steps, ([\d,]+) tokens", text) for text in (out, rejoined.text())]
    (lived_steps, lived_tokens), (back_steps, back_tokens) = (
        [int(n.replace(",", "")) for n in d.groups()] for d in done
    )
    assert (lived_steps, back_steps) == (KILL_STEPS, KILL_STEPS - first + 1), done
    assert back_tokens * lived_steps == lived_tokens * back_steps, done
    together = {h["step"]: h for h in lived["history"] if h["step"] >= first}
    for h in back["history"]:
        assert h["loss"] == pytest.approx(together[h["step"]]["loss"], rel=1e-6), h["step"]
        assert h["quorum"] == together[h["step"]]["quorum"] == 2
    assert back["checksums"] == lived["checksums"]


DILOCO_STEPS, SYNC_STEPS, OUTER_LR, OUTER_MOMENTUM = 6, 2, 0.7, 0.9


@pytest.mark.slow
def test_diloco_and_local_sgd_equal_plain_torch(tmp_path):
    """Pairs of one-process groups of Qwen3-MoE under torchft's DiLoCo and LocalSGD: weights and
    expert biases equal right after each sync and different between syncs; every loss and grad
    norm, the final weights and expert biases, as a DiLoCo written in plain torch over the same
    trainer (tests/helpers/diloco_reference.py; local SGD is its outer lr 1 without momentum: the
    groups' average; the biases are averaged at each sync)."""
    base = with_overrides(
        EQUIVALENCE_ARGS,
        ["--training.steps", str(DILOCO_STEPS), "--training.local_batch_size", "4"],
        MOE_MODELS["qwen3_moe"],
    )
    outer_args = ["--fault_tolerance.outer_lr", str(OUTER_LR), "--fault_tolerance.outer_momentum", str(OUTER_MOMENTUM)]
    methods = {"diloco": outer_args, "local_sgd": []}
    outers = [[OUTER_LR, OUTER_MOMENTUM], [1.0, 0.0]]
    with contextlib.ExitStack() as stack:
        runs = {}
        for method, outer in methods.items():
            address = stack.enter_context(lighthouse(min_replicas=2))
            args = [
                *base,
                *GROUPS,
                "--fault_tolerance.semi_sync_method",
                method,
                "--fault_tolerance.sync_steps",
                str(SYNC_STEPS),
                *outer,
                "--job.dump_folder",
                str(tmp_path / method),
            ]
            runs[method] = [Group(g, 1, args, tmp_path, address, tag=method) for g in (0, 1)]
        reference_argv = [str(REFERENCE), str(tmp_path / "reference.json"), str(SYNC_STEPS), str(tmp_path / "ref")]
        references = run_python([*reference_argv, json.dumps(outers), *base], timeout=240)
        results = {method: [group.wait(180) for group in groups] for method, groups in runs.items()}
    for method, reference in zip(methods, references):
        ours = results[method]
        for step, (a, b) in enumerate(zip(ours[0]["weights"], ours[1]["weights"]), start=1):
            assert (a == b) == (step % SYNC_STEPS == 0), f"{method} step {step}: groups' weights equal: {a == b}"
        for g, result in enumerate(ours):
            assert step_numbers(result["history"]) == list(range(1, DILOCO_STEPS + 1))
            # no quorum before the first sync (torchft's count is 0 then), the sync's after it
            quorums = [h.get("quorum") for h in result["history"]]
            assert quorums == [None] * (SYNC_STEPS - 1) + [2] * (DILOCO_STEPS - SYNC_STEPS + 1), method
            for got, ref in zip(result["history"], reference["histories"][g]):
                for key in ("loss", "grad_norm"):
                    assert got[key] == pytest.approx(ref[key], rel=1e-5), f"{method} {g} step {ref['step']} {key}"
            assert result["sums"] == pytest.approx(reference["sums"][g], rel=1e-5, abs=1e-6), method
            assert result["biases"].keys() == reference["biases"][g].keys() and result["biases"], method
            for layer, bias in reference["biases"][g].items():
                assert result["biases"][layer] == pytest.approx(bias, abs=1e-7), f"{method} {g} {layer}"


@pytest.mark.slow
def test_unreachable_lighthouse_is_one_line(tmp_path):
    """No lighthouse at TORCHFT_LIGHTHOUSE: one line naming it, exit code 2, after
    process_group_timeout_ms (the Manager's connect timeout), no traceback; in the same
    interpreter, process_group nccl on a torch without CUDA: one line, exit code 2."""
    env = {**run_env(), "TORCHFT_LIGHTHOUSE": f"http://localhost:{free_port()}"}
    argv = [*FT_ARGS, "--fault_tolerance.process_group_timeout_ms", "2000", "--job.dump_folder", str(tmp_path)]
    nccl = [*argv, "--fault_tolerance.process_group", "nccl"]
    runs = run_mains("titanlite.train", [argv, nccl], timeout=120, env=env)
    for run in runs:
        lines = [line for line in (run.stdout + run.stderr).splitlines() if "titanlite: error:" in line]
        assert run.returncode == 2 and len(lines) == 1, run.stderr[-3000:]
        assert "Traceback" not in run.stderr
    first, second = (run.stdout + run.stderr for run in runs)
    assert "the lighthouse TORCHFT_LIGHTHOUSE=http://localhost:" in first and "is unreachable" in first
    assert "fault_tolerance.process_group: nccl needs CUDA devices" in second or torch.cuda.is_available()


WAIT_STEPS, WAIT_KILL_AT = 12, 3


@pytest.mark.slow
def test_below_min_replica_size_training_waits_and_a_failure_at_the_heal(tmp_path):
    """min_replica_size 2 of 2 one-process groups of DeepSeek-V3 (MoE): when one is killed the
    other commits no step alone and says it waits; the group started again is killed once more as
    the quorum that heals it forms (a second failure during the heal): the other waits again;
    started a third time it heals (expert biases too), the two go on together and end bit-equal."""
    args = [
        *with_overrides(FT_ARGS, ["--training.steps", str(WAIT_STEPS)], MOE_MODELS["deepseek_v3"]),
        "--fault_tolerance.min_replica_size",
        "2",
        "--job.dump_folder",
        str(tmp_path / "ft"),
    ]
    with lighthouse(min_replicas=1) as address:
        groups = [Group(g, 1, args, tmp_path, address) for g in (0, 1)]
        started = list(groups)
        try:
            for group in groups:
                group.wait_for(rf"^\S+ step +{WAIT_KILL_AT} ", 120)
            victim = next((g for g in groups if "healed from a live group" in g.text()), groups[1])
            survivor = groups[1 - victim.replica]
            waiting, going_on = r"fewer than min_replica_size 2: waiting for more", r"2/2 groups; training goes on"
            waits = survivor.count(waiting)
            victim.kill()
            survivor.wait_for(waiting, 120, seen=waits)
            goes_on, waits = survivor.count(going_on), survivor.count(waiting)
            second = Group(victim.replica, 1, args, tmp_path, address, tag="_second")
            started.append(second)
            survivor.wait_for(going_on, 120, seen=goes_on)
            second.kill()
            survivor.wait_for(waiting, 120, seen=waits)
            rejoined = Group(victim.replica, 1, args, tmp_path, address, tag="_restarted")
            started.append(rejoined)
            lived, back = survivor.wait(300), rejoined.wait(300)
        finally:
            for group in started:
                group.stop()
    out = survivor.text()
    assert step_numbers(lived["history"]) == list(range(1, WAIT_STEPS + 1))
    assert re.search(r"step \d+: 2/2 groups; training goes on", out), out[-3000:]
    assert all(h["quorum"] == 2 for h in lived["history"] if h["step"] > 1)  # never a step alone
    healed = re.search(rf"step (\d+): replica group {victim.replica} healed from a live group", rejoined.text())
    assert healed, rejoined.text()[-3000:]
    # The heal came while the survivor waited inside a step it redoes: the joiner starts at that
    # very step, from the state before it drew its batches.
    assert step_numbers(back["history"]) == list(range(int(healed[1]), WAIT_STEPS + 1))
    together = {h["step"]: h for h in lived["history"]}
    for h in back["history"]:
        assert h["loss"] == pytest.approx(together[h["step"]]["loss"], rel=1e-6), h["step"]
    assert back["checksums"] == lived["checksums"]


@pytest.mark.slow
def test_a_group_that_stays_away_ends_in_one_line(tmp_path):
    """Below min_replica_size for longer than quorum_timeout_ms: one line naming it, exit code 2;
    also when the lighthouse's own deadline ends the wait."""
    argv = [
        *FT_ARGS,
        "--fault_tolerance.min_replica_size",
        "2",
        "--fault_tolerance.quorum_timeout_ms",
        "3000",
        "--job.dump_folder",
        str(tmp_path),
    ]
    with lighthouse(min_replicas=1) as address:
        (run,) = run_mains("titanlite.train", [argv], timeout=120, env={**run_env(), "TORCHFT_LIGHTHOUSE": address})
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "titanlite: error:" in line]
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-3000:]
    assert "no quorum of min_replica_size 2 replica groups at step 1 within quorum_timeout_ms 3000" in lines[0]
    assert "fewer than min_replica_size 2: waiting for more" in run.stderr + run.stdout
    assert "Traceback" not in run.stderr
    # A lighthouse of min_replicas 2: its own deadline ends the quorum call, a gRPC status whose
    # message (not its metadata) ends the line.
    with lighthouse(min_replicas=2) as address:
        (run,) = run_mains("titanlite.train", [argv], timeout=120, env={**run_env(), "TORCHFT_LIGHTHOUSE": address})
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "titanlite: error:" in line]
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-3000:]
    assert "replica groups at step 1 within quorum_timeout_ms 3000" in lines[0], lines[0]
    assert lines[0].endswith("): Timeout expired") and "MetadataMap" not in lines[0], lines[0]


SCRIPT_STEPS = 40  # the kill comes at group 1's first step in a quorum of two, well before the end


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (Linux /proc); none once it has exited."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return []
    return [pid, *(p for child in children for p in process_tree(int(child)))]


@pytest.mark.slow
def test_run_ft_local_script(tmp_path):
    """The documented start on one host: scripts/run_ft_local.sh GROUPS PROCS [args] starts a
    lighthouse and the groups under titanlite.launch; both train in one quorum until group 1 is
    killed (kill -9 of its launcher and worker); group 0 trains on to the end, its log holds its own
    lines only (no torchft traceback), and the script exits 0 with one line for the lost group. A
    bad count is one usage line and exit code 2."""
    script = str(REPO / "scripts" / "run_ft_local.sh")
    env = {**run_env(), "LOG_DIR": str(tmp_path / "logs"), "PYTHON": sys.executable, "MIN_REPLICAS": "2"}
    env["LIGHTHOUSE_PORT"] = str(free_port())
    bad = subprocess.run(["bash", script, "two", "1"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "usage:" in bad.stderr
    steps = ["--training.steps", str(SCRIPT_STEPS)]
    args = [*with_overrides(EQUIVALENCE_ARGS, steps), "--job.dump_folder", str(tmp_path / "out")]
    env["MIN_REPLICAS"] = "1"  # the survivor goes on alone
    run = subprocess.Popen(["bash", script, "2", "1", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        started = [next(line for line in run.stdout if line.startswith(b"replica group")) for _ in (0, 1)]
        log = tmp_path / "logs" / "replica_1.log"
        deadline = time.monotonic() + 120 * timeout_scale()
        while time.monotonic() < deadline and not (
            log.exists() and re.search(r"step +\d+ .*quorum 2/2", log.read_text())
        ):
            time.sleep(0.05)
        for pid in process_tree(int(re.search(rb"\(pid (\d+)\)", started[1])[1])):
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(pid, signal.SIGKILL)
        out, err = run.communicate(timeout=300 * timeout_scale())
    finally:
        if run.poll() is None:  # a failure above: SIGTERM, so the script's trap ends its lighthouse and groups
            run.terminate()
            run.communicate(timeout=60)
    survivor = (tmp_path / "logs" / "replica_0.log").read_text()
    assert run.returncode == 0, err.decode() + survivor[-4000:]
    assert "replica group 1 was killed (exit status 137); the job went on without it" in err.decode()
    trained = [int(s) for s in re.findall(r"step +(\d+) ", survivor)]  # from its heal if group 1 started first
    assert trained == list(range(trained[0], SCRIPT_STEPS + 1)), survivor[-3000:]
    assert re.search(r"step +\d+ .*quorum 2/2", survivor) and "quorum shrank to 1/2" in survivor, survivor[-3000:]
    assert_own_lines_only(survivor)


def assert_own_lines_only(log: str) -> None:
    """A fault-tolerant group's log: titanlite's lines, none of torchft's (its traceback per rank
    for a peer's failure, its checkpoint server's access lines)."""
    for noise in ("Traceback", "got exception", "HTTP/1.1", "Connection closed by peer"):
        assert noise not in log, f"{noise!r} in the log:\n{log[-3000:]}"
