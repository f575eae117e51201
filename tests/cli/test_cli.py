"""The `pipetrain` command: profile -> plan -> simulate, infeasible caps, PipeDream profiles and
bad input. Commands run in-process through ``main(argv)`` (the exit status is its return value),
except one run through ``python -m pipetrain`` to check the real entry point and status, and
the planning commands run by a Python that cannot import torch."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from partitioner import Plan, Profile, format_bytes
from partitioner.costs import held_weight_bytes, problem_from_profile
from partitioner.pipedream import DATA_DIR
from pipetrain.runtime.planning import layer_signature
from pipetrain.tools.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
MODEL = "examples.models:resnet_like"
TINY = """--input-shape 4,3,8,8 --kwargs '{"width": 8}' --warmup 0 --repeats 1"""


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    """`examples.models` is found as `python -m` finds it: from the current directory."""
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "profile.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        assert main(shlex.split(f"profile {MODEL} {TINY} --optimizer adam -o {path}")) == 0
    return path


def run(command: str, capsys) -> tuple[int, str, str]:
    """``pipetrain COMMAND`` (split as a shell would): exit status, stdout, stderr."""
    code = main(shlex.split(command))
    out, err = capsys.readouterr()
    return code, out, err


def test_profile_names_layers_as_the_model_does(profile_path):
    from examples.models import resnet_like

    profile = Profile.load(profile_path)
    names, counts = layer_signature(resnet_like(width=8))
    assert profile.names == names
    assert [layer.param_count for layer in profile.layers] == counts
    assert profile.batch_size == 4
    assert profile.input_bytes == 4 * 3 * 8 * 8 * 4
    first = profile.layers[0]
    assert first.activation_bytes == 4 * 8 * 8 * 8 * 4  # Conv2d(3, 8) output, fp32
    assert all(layer.optimizer_state_bytes == 2 * layer.param_bytes for layer in profile.layers)
    assert all(layer.forward > 0 for layer in profile.layers)
    assert all(layer.backward > 0 for layer in profile.layers[1:])


def test_profile_plan_simulate_agree(profile_path, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    code, out, err = run(
        f"plan {profile_path} --stages 2 --microbatches 4 --memory 1GiB --bandwidth 1GB/s "
        f"-o {plan_path}",
        capsys,
    )
    assert code == 0, err
    plan = Plan.load(plan_path)
    assert plan.stages == 2 and plan.microbatches == 4 and plan.microbatch_size == 4
    assert sum(plan.balance) == 16

    # Every stage row of the table carries the plan's numbers.
    row = r"^\s+(\d+)\s+(\d+)-(\d+)\s+(\S+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+ \S+)\s+(no)$"
    rows = {int(m.group(1)): m for m in re.finditer(row, out, re.M)}
    assert sorted(rows) == [0, 1]
    for t, stage in enumerate(plan.per_stage):
        row = rows[t]
        assert (int(row.group(2)), int(row.group(3)) + 1) == tuple(stage.layers)
        assert row.group(5) == f"{sum(stage.param_counts):,}"
        assert row.group(6) == f"{stage.compute_time * 1e3:.3f}"
        assert row.group(7) == f"{stage.transfer_time * 1e3:.3f}"
        assert row.group(8) == format_bytes(stage.memory_bytes)  # adaptive units: KiB, MiB
    assert f"step {plan.step_time * 1e3:.3f} ms" in out
    assert f"bubble {plan.bubble_fraction:.1%}" in out
    assert f"{plan.samples_per_second:,.1f} samples/s" in out
    assert f"balance {plan.balance}" in out

    # Simulating the plan, or the profile split the same way, predicts the plan's step.
    step = f"predicted step time {plan.step_time * 1e3:.3f} ms"
    code, out, err = run(f"simulate {plan_path}", capsys)
    assert code == 0, err
    assert step in out and f"bubble fraction {plan.bubble_fraction:.1%}" in out
    assert "peak in-flight micro-batches per stage: [2, 1]" in out  # 1f1b, 2 stages
    balance = ",".join(map(str, plan.balance))
    split = f"simulate {profile_path} --balance {balance} --microbatches 4"
    code, out, err = run(f"{split} --bandwidth 1GB/s", capsys)
    assert code == 0, err
    assert step in out
    code, out, err = run(f"{split} --schedule gpipe", capsys)
    assert code == 0, err
    assert "peak in-flight micro-batches per stage: [4, 4]" in out

    # On a shared host the plan, and simulating it, predict the same (longer) step.
    shared_path = tmp_path / "shared.json"
    host = "--cores 1 --overhead-ms 0.05"
    code, out, err = run(f"plan {profile_path} --stages 2 --microbatches 4 --memory 1GiB "
                         f"--bandwidth 1GB/s {host} -o {shared_path}", capsys)
    assert code == 0, err
    shared = Plan.load(shared_path)
    assert shared.balance == plan.balance and shared.step_time > plan.step_time
    assert "(stages sharing 1 cores; runtime overhead 0.050 ms per action)" in out
    code, out, err = run(f"simulate {shared_path}", capsys)
    assert code == 0, err
    assert f"predicted step time {shared.step_time * 1e3:.3f} ms" in out


def test_infeasible_cap_names_a_cap_that_works(profile_path, tmp_path, capsys):
    args = f"plan {profile_path} --stages 3 --microbatches 4"
    code, out, err = run(f"{args} --memory 10kB", capsys)
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    found = re.search(r"smallest memory cap that fits: --memory (\d+)", err)
    assert found, err
    cap = int(found.group(1))
    code, out, err = run(f"{args} --memory {cap} -o {tmp_path / 'p.json'}", capsys)
    assert code == 0, err
    assert max(s.memory_bytes for s in Plan.load(tmp_path / "p.json").per_stage) <= cap
    assert run(f"{args} --memory {cap - 1}", capsys)[0] == 2  # and it is the smallest


def test_a_cap_that_replicas_meet_only_by_sharding_is_planned_under_zero(
    profile_path, tmp_path, capsys
):
    """Issue 41: 2 stages on 4 devices; the smallest cap without ZeRO is infeasible, names
    --zero 3, and fits under it, which the plan says."""
    args = f"plan {profile_path} --stages 2 --microbatches 4 --devices 4 --checkpoint never"
    code, _, err = run(f"{args} --memory 1kB", capsys)
    assert code == 2 and "--zero 3" in err
    whole = int(re.search(r"smallest memory cap that fits: --memory (\d+)", err).group(1))
    assert run(f"{args} --memory {whole - 1}", capsys)[0] == 2
    code, out, err = run(f"{args} --memory {whole - 1} --zero 3 -o {tmp_path / 'p.json'}", capsys)
    assert code == 0, err
    assert "train with Pipeline(..., zero=3, reduce_scatter=" in out
    assert f"reduce_scatter: {Plan.load(tmp_path / 'p.json').reduce_scatter} (" in out
    planned = Plan.load(tmp_path / "p.json")
    assert max(s.memory_bytes for s in planned.per_stage) < whole
    assert any(len(s.ranks) > 1 for s in planned.per_stage)


def test_plan_recomputes_when_the_cap_needs_it(profile_path, tmp_path, capsys):
    """Issue 31, item 9: a cap that only recomputation meets is planned by default (before,
    infeasible unless --checkpoint always), and messages name flags never already in force."""
    args = f"plan {profile_path} --stages 2 --microbatches 4 --schedule gpipe"
    code, _, err = run(f"{args} --checkpoint never --memory 1kB", capsys)
    assert code == 2
    assert "--checkpoint auto" in err and "--schedule 1f1b" in err
    assert "checkpoint='" not in err and "checkpoint=" not in err
    keeping = int(re.search(r"smallest memory cap that fits: --memory (\d+)", err).group(1))
    code, out, err = run(f"{args} --memory {keeping - 1} -o {tmp_path / 'p.json'}", capsys)
    assert code == 0, err
    planned = Plan.load(tmp_path / "p.json")
    assert "always" in planned.checkpoints and planned.checkpoint == "auto"
    assert max(s.memory_bytes for s in planned.per_stage) < keeping
    assert re.search(r"recomputing on stages \[\d", out) and re.search(r" yes$", out, re.M)
    code, _, err = run(f"{args} --checkpoint always --memory 1kB", capsys)
    assert code == 2 and "--checkpoint" not in err.split("smallest memory cap")[0]
    assert "--schedule 1f1b" in err


def test_plan_pipedream_profiles(tmp_path, capsys):
    out_path = tmp_path / "vgg.json"
    options = "--stages 4 --microbatches 8 --bandwidth 25GB/s"
    code, out, err = run(f"plan pipedream:vgg16 {options} -o {out_path}", capsys)
    assert code == 0, err
    by_name = Plan.load(out_path)
    assert by_name.stages == 4 and sum(by_name.balance) == 40
    assert by_name.microbatch_size == 128  # inferred from the fp32 224x224 input
    assert f"step {by_name.step_time * 1e3:.3f} ms" in out

    graph = tmp_path / "graph.txt"  # the same profile, as a file
    shutil.copy(DATA_DIR / "vgg16.graph.txt", graph)
    code, out, err = run(f"plan {graph} {options} --batch-size 128", capsys)
    assert code == 0, err
    assert f"balance {by_name.balance}" in out

    code, out, err = run(f"plan pipedream:gnmt {options}", capsys)
    assert code == 2 and "batch" in err  # GNMT's profile does not record its batch size
    code, out, err = run(f"plan pipedream:gnmt {options} --batch-size 64", capsys)
    assert code == 0, err
    code, out, err = run(f"plan pipedream:nosuch {options}", capsys)
    assert code == 2 and "vgg16" in err  # lists the shipped ones


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("no_such_module:build", "cannot import 'no_such_module'"),
        ("examples.models:nope", "has no function 'nope'; it has: "),
        ("examples.models", "expected MODULE:FUNCTION"),
        ("missing/file.py:build", "no such file: missing/file.py"),
    ],
)
def test_bad_module_path(target, expected, capsys):
    code, out, err = run(f"profile {target} --input-shape 2,3", capsys)
    assert code == 2
    assert expected in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_bad_inputs_exit_2_with_one_line(profile_path, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    split = "--stages 2 --microbatches 2"
    assert run(f"plan {profile_path} {split} -o {plan_path}", capsys)[0] == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "pipetrain-profile", "version": 99, "layers": []}))
    cases = [
        (f"profile {MODEL} --input-shape 4,x3", "--input-shape must be positive integers"),
        # The model rejects 5 input channels: the message names the layer and the input.
        (f"profile {MODEL} {TINY} --input-shape 4,5,8,8", "layer 0 (0:Conv2d) failed on an input"),
        (f"profile {MODEL} {TINY} --kwargs '{{\"widht\": 8}}'", "unexpected keyword argument"),
        (f"profile {MODEL} {TINY} --input-dtype int64", "needs --input-high"),
        (f"profile {MODEL} {TINY} --input-dtype floaty", "unknown --input-dtype 'floaty'"),
        (f"plan missing.json {split}", "no such file"),
        (f"plan {plan_path} {split}", "is a plan"),
        (f"plan {bad} {split}", "version 99 is not supported"),
        (f"plan {profile_path} {split} --bandwidth fast", "cannot read 'fast' as a bandwidth"),
        (f"plan {profile_path} --stages 40 --microbatches 2", "use at most 16 stages"),
        (f"simulate {profile_path} --balance 3,3 --microbatches 2", "the profile's 16 layers"),
        (f"simulate {profile_path} --microbatches 2", "needs --balance"),
        (f"plan {profile_path} {split} --cores 0", "cores must be at least 1"),
    ]
    for command, expected in cases:
        code, out, err = run(command, capsys)
        assert code == 2, command
        assert expected in err, (command, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_integer_inputs_profile_a_language_model(tmp_path, capsys):
    path = tmp_path / "lm.json"
    kwargs = '{"vocab": 50, "dim": 16, "blocks": 2, "heads": 2, "context": 8}'
    code, out, err = run(
        f"profile examples.models:gpt --input-shape 2,6 --input-dtype int64 "
        f"--input-high 50 --kwargs '{kwargs}' --optimizer sgd --warmup 0 --repeats 1 -o {path}",
        capsys,
    )
    assert code == 0, err
    profile = Profile.load(path)
    assert [layer.name for layer in profile.layers] == [
        "0:Embedding",
        "1:Block",
        "2:Block",
        "3:Head",
    ]
    assert profile.layers[-1].activation_bytes == 2 * 6 * 50 * 4
    assert profile.layers[0].backward > 0  # the embedding's weights get gradients
    assert all(layer.optimizer_state_bytes == 0 for layer in profile.layers)


def test_a_tied_weight_is_profiled_and_planned_whole_under_zero_3(tmp_path, capsys):
    """The GPT's head reads the token embedding's weight: the profile records those bytes on
    both layers, and at --zero 3 the planner keeps them whole (weight, gradient and Adam's
    two moments) while it divides the rest by the replicas, as the runtime does, so the
    smallest cap grows against the same profile without the tie."""
    path = tmp_path / "lm.json"
    kwargs = '{"vocab": 64, "dim": 16, "blocks": 2, "heads": 2, "context": 8}'
    code, _, err = run(
        f"profile examples.models:gpt --input-shape 2,8 --input-dtype int64 --input-high 64 "
        f"--kwargs '{kwargs}' --optimizer adam --warmup 0 --repeats 1 -o {path}",
        capsys,
    )
    assert code == 0, err
    profile = Profile.load(path)
    token = 64 * 16 * 4  # the tied weight's fp32 bytes
    assert [layer.tied_bytes for layer in profile.layers] == [token, 0, 0, token]
    # gradients reduced per micro-batch: sharded like the weights and the state
    problem = problem_from_profile(profile, stages=2, microbatches=4, devices=4, zero=3,
                                   reduce_scatter="microbatch")
    held = held_weight_bytes(problem, 2)
    for at in (0, -1):  # the position embedding, the head's norm: divided by 2 replicas
        rest = profile.layers[at].param_bytes - token
        assert rest > 0 and held[at] == 4 * token + 4 * (rest // 2)
    untied = tmp_path / "untied.json"
    Profile(profile.device, profile.batch_size,
            [replace(layer, tied_bytes=0) for layer in profile.layers],
            profile.input_bytes).save(untied)
    caps = []
    for file in (path, untied):
        code, _, err = run(f"plan {file} --stages 2 --microbatches 4 --devices 4 --zero 3 "
                           "--checkpoint never --memory 1kB", capsys)
        assert code == 2
        caps.append(int(re.search(r"smallest memory cap that fits: --memory (\d+)", err)[1]))
    assert caps[0] > caps[1]


def test_module_entry_point_exit_status(tmp_path):
    command = "plan pipedream:alexnet --stages 2 --microbatches 2 --memory 1MB"
    done = subprocess.run(
        [sys.executable, "-m", "pipetrain", *command.split()],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("pipetrain plan: error: infeasible: ")
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


WITHOUT_TORCH = """
import sys
from importlib.abc import MetaPathFinder


class NoTorch(MetaPathFinder):
    \"\"\"torch and transformers missing, as on a laptop that only plans.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, NoTorch())
"""


def _without_torch(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh Python that cannot import torch or transformers."""
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH + code], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


def test_planning_commands_run_without_torch(profile_path, tmp_path):
    """The README's promise: `pipetrain plan`, `simulate` and `schedule` never import torch,
    so they run where it is not installed; `import pipetrain` works there too, and a name
    that needs torch says so when used."""
    plan_path = tmp_path / "plan.json"
    done = _without_torch(
        "from pipetrain.tools.cli import main\n"
        f"assert main(['plan', {str(profile_path)!r}, '--stages', '2', '--microbatches', '4', "
        f"'--memory', '1GiB', '-o', {str(plan_path)!r}]) == 0\n"
        f"assert main(['simulate', {str(plan_path)!r}]) == 0\n"
        "assert main(['schedule', 'zbv', '--stages', '4', '--ranks', '2', "
        "'--microbatches', '4']) == 0\n"
        "assert main(['--help']) == 0\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert Plan.load(plan_path).stages == 2
    assert "layers -> 2 stages, balance" in done.stdout  # the plan, printed
    assert "bubble" in done.stdout and "zbv: 4 stages on 2 ranks" in done.stdout
    assert "profile" in done.stdout and "consolidate" in done.stdout  # every command listed
    assert done.stdout.splitlines()[-1] == "False False"
    done = _without_torch(
        "import pipetrain\n"
        "print(pipetrain.__version__ != '', pipetrain.PipelineError.__name__)\n"
        "try:\n    pipetrain.Pipeline\n"
        "except ImportError as error:\n    print(type(error).__name__, error)\n",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "True PipelineError"
    assert done.stdout.splitlines()[1].startswith("ModuleNotFoundError pipetrain.Pipeline needs "
                                                  "torch")


def test_the_command_list_is_each_commands_own():
    """``pipetrain --help`` lists every command with cli.py's line for it, which imports no
    command's module: the lines are the ones the modules' own parsers give."""
    assert build_parser().format_help() == build_parser([]).format_help()


def test_trace_and_consolidate_verbs(tmp_path, capsys):

    from pipetrain import Pipeline
    from pipetrain.tools.cli import main
    from tests.runtime.models import batches, mlp, sgd

    pipe = Pipeline(mlp(), [6, 6], chunks=4, devices=["cpu", "cpu"], trace=tmp_path / "t",
                    loss_fn=torch.nn.functional.cross_entropy, optimizer=sgd)
    for x, y in batches(2):
        pipe.train_step(x, y)
    pipe.save_trace()
    pipe.save(tmp_path / "ckpt")
    assert main(["trace", str(tmp_path / "t"), "--no-png"]) == 0
    out = capsys.readouterr().out
    assert "2 ranks, 2 steps traced" in out and (tmp_path / "t" / "trace.json").exists()
    from pipetrain.observe.trace import load_folder, step_overheads

    overheads = step_overheads(load_folder(tmp_path / "t"))
    assert len(overheads) == 2 and all(o > 0 for o in overheads)
    listed = ", ".join(f"{o * 1e3:.3f}" for o in overheads)
    assert f"runtime overhead per action, ms per rank: {listed}" in out
    assert main(["consolidate", str(tmp_path / "ckpt"), "-o", str(tmp_path / "m.pt")]) == 0
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(state) == list(mlp().state_dict())
    assert main(["trace", str(tmp_path / "missing")]) == 2
    assert "no trace-rank*.json" in capsys.readouterr().err


def test_simulate_draws_the_timeline(tmp_path, capsys):
    from pipetrain.tools.cli import main

    png = tmp_path / "sim.png"
    code = main(["simulate", "pipedream:vgg16", "--balance", "10,10,10,10", "--microbatches",
                 "4", "--png", str(png)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert png.stat().st_size > 10_000 and "timeline picture" in out.out


def test_wrongly_typed_json_fields_exit_2_with_one_line(profile_path, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    assert run(f"plan {profile_path} --stages 2 --microbatches 2 -o {plan_path}", capsys)[0] == 0
    good_plan = json.loads(plan_path.read_text())
    good_profile = json.loads(profile_path.read_text())

    def broken(data: dict, edit, name: str) -> Path:
        data = json.loads(json.dumps(data))
        edit(data)
        path = tmp_path / name
        path.write_text(json.dumps(data))
        return path

    cases = [
        ("simulate", broken(good_plan, lambda d: d.update(balance="2,2,1,11"), "p1.json"),
         "field 'balance' must be list[int], got '2,2,1,11'"),
        ("simulate", broken(good_plan, lambda d: d.update(microbatches=4.5), "p2.json"),
         "field 'microbatches' must be int"),
        ("simulate", broken(good_plan, lambda d: d["per_stage"][0].update(layers="0,3"),
                            "p3.json"), "stage 0: field 'layers' must be tuple[int, int]"),
        ("plan", broken(good_profile, lambda d: d["layers"][1].update(optimizer_state_bytes="8"),
                        "f1.json"), "layer 1: field 'optimizer_state_bytes' must be int"),
        ("plan", broken(good_profile, lambda d: d.update(input_bytes=2.5), "f2.json"),
         "field 'input_bytes' must be int, got 2.5"),
    ]
    for verb, path, expected in cases:
        options = "--stages 2 --microbatches 2" if verb == "plan" else ""
        code, out, err = run(f"{verb} {path} {options}", capsys)
        assert code == 2, (path, out)
        assert expected in err, (path, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_pictures_without_matplotlib_name_the_extra(tmp_path, capsys, monkeypatch):
    """matplotlib made unimportable (None in sys.modules, as the import system reads it): a
    picture request is one line naming the `viz` extra, exit status 2; --no-png still works."""
    from pipetrain import Pipeline
    from tests.runtime.models import batches, mlp, sgd

    pipe = Pipeline(mlp(), [6, 6], chunks=2, devices=["cpu", "cpu"], trace=tmp_path / "t",
                    loss_fn=torch.nn.functional.cross_entropy, optimizer=sgd)
    for x, y in batches(1):
        pipe.train_step(x, y)
    pipe.save_trace()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    simulate = "simulate pipedream:vgg16 --balance 10,10,10,10 --microbatches 4"
    for command, instead in [
        (f"trace {tmp_path / 't'}", "pass --no-png"),
        (f"{simulate} --png {tmp_path / 'sim.png'}", "leave out --png"),
    ]:
        code, out, err = run(command, capsys)
        assert code == 2, err
        assert err.splitlines() == [
            f'pipetrain {command.split()[0]}: error: drawing needs matplotlib: '
            f'pip install "pipetrain[viz]" (or {instead})'
        ]
    code, out, err = run(f"trace {tmp_path / 't'} --no-png", capsys)
    assert code == 0 and "2 ranks, 1 steps traced" in out, err


@pytest.mark.slow  # five interpreter starts
def test_consolidate_errors_are_one_line_with_exit_status_2(tmp_path):
    """Today: tracebacks for a tampered file, a bad `latest`, a missing output folder, and
    "No such file ... manifest.json" for a folder without a checkpoint (issue 22, item 7)."""
    from pipetrain import Pipeline
    from tests.runtime.models import mlp

    def consolidate(folder, output):
        done = subprocess.run(
            [sys.executable, "-m", "pipetrain", "consolidate", str(folder), "-o", str(output)],
            capture_output=True, text=True, timeout=120,
        )
        if done.returncode:
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("pipetrain consolidate: error: "), lines
        return done.returncode, done.stderr

    pipe = Pipeline(mlp(), [6, 6], devices=["cpu", "cpu"])
    pipe.save(tmp_path / "ckpt")
    code, err = consolidate(tmp_path / "ckpt", tmp_path / "no" / "m.pt")
    assert code == 2 and f"{tmp_path / 'no'} does not exist" in err
    (tmp_path / "empty").mkdir()
    code, err = consolidate(tmp_path / "empty", tmp_path / "m.pt")
    assert code == 2 and "holds no checkpoint" in err
    (tmp_path / "ckpt" / "latest").write_text("../../etc")
    code, err = consolidate(tmp_path / "ckpt", tmp_path / "m.pt")  # falls back, says so
    assert code == 0 and "warning: " in err and "using step-00000000" in err
    shutil.rmtree(tmp_path / "ckpt" / "step-00000000")
    code, err = consolidate(tmp_path / "ckpt", tmp_path / "m.pt")
    assert code == 2 and "holds no checkpoint" in err
    pipe.save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "step-00000000" / "stage-1.pt").write_bytes(b"tampered")
    code, err = consolidate(tmp_path / "ckpt", tmp_path / "m.pt")
    assert code == 2 and "stage-1.pt is " in err


TASK = '''
import torch
from torch import nn
import pipetrain

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

def task(samples=16):
    def batch(step):
        x = torch.randn(samples, 8, generator=torch.Generator().manual_seed(step))
        return x, (x[:, 0] > 0).long()
    return pipetrain.TrainTask(model(), nn.functional.cross_entropy,
                               lambda params: torch.optim.SGD(params, lr=0.1), batch)

def not_a_task():
    return model()
'''


@pytest.fixture(scope="module")
def task_plan(tmp_path_factory) -> tuple[Path, Path]:
    """A task module and its plan: 2 stages, 4 micro-batches of 4 samples (16 a step)."""
    folder = tmp_path_factory.mktemp("task")
    (folder / "mytask.py").write_text(TASK)
    module = folder / "mytask.py"
    assert main(shlex.split(f"profile {module}:model --input-shape 4,8 --warmup 0 --repeats 1 "
                            f"-o {folder / 'profile.json'}")) == 0
    assert main(shlex.split(f"plan {folder / 'profile.json'} --stages 2 --microbatches 4 "
                            f"-o {folder / 'plan.json'}")) == 0
    return module, folder / "plan.json"


@pytest.mark.parametrize(("extra", "message"), [
    ("--kwargs '{\"samples\": 24}'", r"batch\(0\) gives inputs of 24 samples, but the plan trains "
     r"4 micro-batches of 4 samples on each of 1 replica\(s\): 16 a step; return 16 samples, "
     r"or plan for micro-batches of 6 samples"),
    ("--nproc 4 --kwargs '{\"samples\": 16}'", r"gives inputs of 16 samples.*on each of 2 "
     r"replica\(s\): 32 a step"),
    ("--nproc 3", r"the plan runs 2 ranks per pipeline but 3 ranks were asked for"),
    ("--resume", r"--resume needs --checkpoint-dir"),
])
def test_train_refuses_before_starting_processes(task_plan, capsys, extra, message):
    """Checked in the launcher: nothing starts, exit status 2, one line naming the fix."""
    module, plan = task_plan
    code, out, err = run(f"train {module}:task --plan {plan} --steps 2 {extra}", capsys)
    assert code == 2 and re.search(message, err), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # three torchrun runs; test_train_gpt.py refuses a second run fast
def test_train_never_deletes_an_earlier_runs_checkpoints(task_plan, tmp_path, capsys):
    """The README's `pipetrain train ... --steps 40`, then `--steps 10` in the same folder:
    refused before any process starts (the step-40 checkpoint stays); with --fresh a new run
    trains beside the old checkpoints and prunes only its own (real torchrun runs)."""
    module, plan = task_plan
    folder = tmp_path / "ckpt"
    train = f"train {module}:task --plan {plan} --checkpoint-dir {folder}"
    steps = lambda: sorted(p.name for p in folder.iterdir() if p.is_dir())  # noqa: E731
    assert run(f"{train} --steps 4", capsys)[0] == 0
    assert steps() == ["step-00000000", "step-00000004"]
    code, _, err = run(f"{train} --steps 2", capsys)
    assert code == 2 and f"{folder} holds checkpoints of an earlier run (the newest: " \
        "step-00000004)" in err and "--resume" in err and "--fresh" in err, err
    assert run(f"{train} --steps 2 --fresh --checkpoint-every 1", capsys)[0] == 0
    assert steps() == ["step-00000000", "step-00000001", "step-00000002", "step-00000004"]
    code, _, err = run(f"{train} --steps 2 --fresh --resume", capsys)
    assert code == 2 and "--resume and --fresh exclude each other" in err, err


def test_train_starts_torchrun_with_nproc_said_to_it_alone(task_plan):
    """torchrun's parser reads the ranks' options too and takes ``--nproc`` for an ambiguous
    abbreviation of its own ``--nproc-per-node`` (it exited before any rank started): the
    launcher says the count to torchrun and leaves it out of the ranks' arguments."""
    from torch.distributed.run import get_args_parser

    from pipetrain.tools.cli_train import torchrun_command

    module, plan = task_plan
    for nproc in (["--nproc", "4"], ["--nproc=4"]):
        argv = ["train", f"{module}:task", "--plan", str(plan), *nproc, "--steps", "2"]
        args = build_parser(["train"]).parse_args(argv)
        args.argv = argv
        command = torchrun_command(args, Plan.load(plan))
        torchrun = get_args_parser().parse_args(command[3:])
        assert torchrun.nproc_per_node == "4" and torchrun.training_script == "pipetrain"
        assert torchrun.training_script_args == [
            "train", f"{module}:task", "--plan", str(plan), "--steps", "2"]


def test_train_refuses_a_function_that_returns_no_task(task_plan, capsys):
    module, plan = task_plan
    code, _, err = run(f"train {module}:not_a_task --plan {plan} --steps 2", capsys)
    assert code == 2 and "returned a Sequential, not a pipetrain.TrainTask" in err, err


def test_plan_and_simulate_name_the_ranks_of_a_vs_stages(capsys):
    """zbv folds 4 stages over 2 ranks as a V: both commands say which stages each rank
    runs (they used to assume stage s on rank s mod ranks)."""
    code, out, err = run("plan pipedream:vgg16 --stages 4 --microbatches 8 --schedule zbv", capsys)
    assert code == 0, err
    assert "rank 0: stages 0, 3; rank 1: stages 1, 2" in out + err
    code, out, err = run(
        "simulate pipedream:vgg16 --balance 10,10,10,10 --microbatches 8 --schedule zbv", capsys
    )
    assert code == 0, err
    assert "(rank 0: stages 0, 3; rank 1: stages 1, 2)" in out


def test_schedule_exports_a_csv_and_reads_it_back_or_refuses_it(tmp_path, capsys):
    path = tmp_path / "zbv.csv"
    code, out, err = run(f"schedule zbv --stages 4 --ranks 2 --microbatches 4 --to-csv {path}",
                         capsys)
    assert code == 0, err
    assert path.read_text().splitlines()[0].startswith("0F0,")
    code, again, err = run(f"schedule --from-csv {path}", capsys)
    assert code == 0, err
    assert "rank 0: stages 0, 3; rank 1: stages 1, 2" in again and "valid" in again
    assert again.splitlines()[1] == out.splitlines()[1]  # the same simulated step
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1RECV_F0,1B0,1SEND_B0\n")
    code, out, err = run(f"schedule --from-csv {bad}", capsys)
    assert code == 2 and "stage 1 does 1:F0 before 1:RECV_ACT0" in err


def test_plan_without_stages_searches_the_whole_run(profile_path, tmp_path, capsys):
    """Issue 48: `plan PROFILE --devices N --batch-size B --memory CAP` chooses the stages,
    copies, schedule, micro-batches and zero; prints the plan, each other schedule's best and
    what binds; its plan file is one Pipeline runs."""
    from examples.models import resnet_like
    from pipetrain.runtime.planning import load_plan

    out_file = tmp_path / "p.json"
    code, out, err = run(f"plan {profile_path} --devices 2 --batch-size 8 --memory 1GB "
                         f"--explain -o {out_file}", capsys)
    assert code == 0, err
    chosen = re.search(r"^chosen: (\S+), .*: step ([\d.]+) ms, peak .* per rank$", out, re.M)
    assert chosen and re.search(r"^searched [\d,]+ points \(2 devices, batch 8\)", out, re.M)
    planned = Plan.load(out_file)
    assert planned.schedule == chosen.group(1)
    assert planned.pipeline_ranks * planned.data_parallel == 2
    assert planned.microbatches * planned.microbatch_size * planned.data_parallel == 8
    assert f"step {planned.step_time * 1e3:.3f} ms" in out  # the plan's own table
    assert "the best of each other schedule:" in out and "vs chosen" in out
    for bound in ("memory: ", "devices: 2 in use", "batch: "):
        assert re.search(f"^{bound}", out, re.M), bound
    assert "frontier (no other planned point is both faster and lighter):" in out
    # a count of 1 takes the singular (a figure such as "4.1 samples/s" is no count)
    assert not re.search(r"(?<![\w.,])1 (stages|micro-batches|samples|copies)\b", out)
    load_plan(planned, resnet_like(width=8))  # as Pipeline(plan=...) takes it


def test_explain_prints_the_time_memory_frontier_it_searched(profile_path, capsys):
    """Issue 48.4: --explain lists the planned points no other beats in both step time and
    peak memory, fastest (the chosen point) first, each with its schedule, stages,
    micro-batches and zero."""
    code, out, err = run(f"plan {profile_path} --devices 4 --batch-size 8 --memory 1GB "
                         "--explain", capsys)
    assert code == 0, err
    head = "frontier (no other planned point is both faster and lighter):"
    rows = out.split(head, 1)[1].splitlines()[2:]
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    points = [re.fullmatch(r"\s*([\d.]+)\s+([\d.]+) (\w+)  (.+, zero \d)", row) for row in rows]
    assert points and all(points), rows
    times = [float(p.group(1)) for p in points]
    peaks = [float(p.group(2)) * units[p.group(3)] for p in points]
    assert times == sorted(times) and peaks == sorted(peaks, reverse=True)
    assert len(set(peaks)) == len(peaks)  # each later point is strictly lighter
    chosen = re.search(r"^chosen: (.+): step ([\d.]+) ms", out, re.M)
    assert chosen and points[0].group(4) == chosen.group(1)
    assert float(points[0].group(1)) == float(chosen.group(2))


def test_the_search_honours_fixed_choices(profile_path, capsys):
    code, out, err = run(f"plan {profile_path} --devices 2 --batch-size 8 --schedule gpipe "
                         "--zero 0 --stages 2", capsys)
    assert code == 0, err
    assert re.search(r"^chosen: gpipe, 2 stages, \d+ micro-batch(es)? of \d+ samples?, "
                     r"zero 0:", out, re.M)
    assert "the best of each other schedule:" not in out  # one schedule searched
    assert "memory: no cap given" in out


def test_the_search_refuses_naming_the_constraint(profile_path, capsys):
    code, _, err = run(f"plan {profile_path} --devices 2 --batch-size 8 --memory 1kB", capsys)
    assert code == 2 and "no point of the search fits the memory cap" in err
    suggested = re.search(r"the least any needs is .*: pass --memory (\d+MiB) or more, more "
                          r"--devices$", err.strip())
    assert suggested, err  # --checkpoint auto (the default) already recomputes where it helps
    code, out, err = run(f"plan {profile_path} --devices 2 --batch-size 8 --memory "
                         f"{suggested.group(1)}", capsys)
    assert code == 0 and out.startswith("searched"), err  # the cap it names is enough
    code, _, err = run(f"plan {profile_path} --devices 2 --batch-size 8 --memory 1kB "
                       "--checkpoint never", capsys)
    assert code == 2 and err.strip().endswith("more --devices, or --checkpoint auto"), err
    code, _, err = run(f"plan {profile_path} --devices 4 --batch-size 8 --stages 3", capsys)
    assert code == 2 and "--stages 3 does not divide the 4 devices" in err
    code, _, err = run(f"plan {profile_path} --devices 4 --batch-size 3 --stages 1", capsys)
    assert code == 2 and "--batch-size" in err
    code, _, err = run(f"plan {profile_path} --microbatches 4", capsys)
    assert code == 2 and "--devices N and --batch-size B" in err
    code, _, err = run(f"plan {profile_path} --stages 2 --microbatches 4 --explain", capsys)
    assert code == 2 and "--explain" in err
