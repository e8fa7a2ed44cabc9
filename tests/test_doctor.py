"""``omni-accel doctor``: a report of what runs here, and a failing exit for what was asked and cannot."""

import json
import subprocess
import sys

import torch

from omni_accel import cli, doctor


def _report(capsys, *argv) -> tuple[int, str]:
    code = doctor.main(list(argv))
    return code, capsys.readouterr().out


def test_json_report_lists_versions_device_providers_backends_and_caches(capsys):
    code, out = _report(capsys, "--json")
    report = json.loads(out)
    assert code == 0 and report["problems"] == []
    names = {row["name"]: row for row in report["packages"]}
    assert names["torch"]["installed"] == torch.__version__ and names["diffusers"]["ok"]
    providers = {row["name"]: row for row in report["providers"]}
    usable = "sdpa_cudnn" if torch.cuda.is_available() else "sdpa"
    assert providers[usable]["usable"] and providers[usable]["self_test_err"] < 2e-2
    assert not providers["sage"]["lossless"]
    assert all(row["usable"] or row["why_not"] for row in report["providers"])  # never silent
    assert set(report["distributed"]) == {"gloo", "nccl"} and "triton" in report["caches"]


def test_what_was_asked_for_and_cannot_run_fails_with_the_reason(capsys):
    if torch.cuda.is_available():
        code, out = _report(capsys, "--no-self-test", "--attention", "no_such_kernel")
        assert code == 1 and "no such provider" in out
        return
    code, out = _report(capsys, "--no-self-test", "--attention", "sdpa_cudnn")
    assert code == 1 and "--attention sdpa_cudnn: runs on ['cuda'], not cpu" in out
    if not torch.distributed.is_nccl_available():
        code, out = _report(capsys, "--no-self-test", "--backend", "nccl")
        assert code == 1 and "no nccl backend" in out


def test_the_table_and_the_command_line_entry_points():
    done = subprocess.run(
        [sys.executable, "-m", "omni_accel", "doctor", "--no-self-test"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "attention providers" in done.stdout and "distributed:" in done.stdout
    assert cli.main(["no-such-command"]) == 2


def test_help_and_version_answer_without_importing_torch():
    """``omni-accel --help`` / ``--version`` exit 0 with their text and import neither torch nor Diffusers."""
    probe = (
        "import sys\n"
        "from omni_accel import cli\n"
        "code = cli.main(sys.argv[1:])\n"
        "print('HEAVY', sorted({'torch', 'diffusers'} & set(sys.modules)))\n"
        "sys.exit(code)\n"
    )
    for flag, text in (("--help", "omni-accel <command> --help"), ("--version", "omni-accel 0.1.0")):
        done = subprocess.run([sys.executable, "-c", probe, flag], capture_output=True, text=True)
        assert done.returncode == 0 and text in done.stdout, (flag, done.stdout, done.stderr[-2000:])
        assert "HEAVY []" in done.stdout, done.stdout
