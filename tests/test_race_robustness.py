"""`gradcomp race` under signals, failures and unwritable output; its option checks.

The tests that build namespaces need root and iproute2 and are skipped, saying so, without them (as in
test_race.py, whose fixture checks that no namespace is left). The others run no worker, except one small race
with an injected crash.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time

import pytest
from test_race import NEEDS_NETNS, no_leftovers  # noqa: F401 (a fixture, used by name)

from gradcomp import cli
from gradcomp.errors import ConfigError
from gradcomp.experiments.race import command, netns, race
from crash import crash_at


def _args(out, *extra, link="none"):
    argv = ["race", "--method", "torch-fp32", "--method", "qsgd", "--hosts", "2", "--link", link, "--dataset",
            "synthetic", "--model", "mlp", "--steps", "4", "--eval-every", "2", "--compute-steps", "0", "--quiet",
            "--timeout", "60", "--out", str(out), *extra]
    return argv + (["--no-netns"] if link == "none" and "--no-netns" not in extra else [])


def _record(method, cfg, raw, num_parameters):
    """What method_record makes of a finished method (no worker ran)."""
    return {"label": method.label, "name": method.name, "kind": "torch" if method.baseline else "gradcomp",
            "compressor": cfg.compressor, "curve": [[2, 0.5, 0.9], [4, 1.0, 0.99]], "steps": 4, "train_s": 1.0,
            "median_step_s": 0.25, "compute_only_step_s": 0.1, "best_accuracy": 0.99, "final_accuracy": 0.99,
            "peak_rss_bytes": [300 * 2**20], "peak_anon_bytes": [300 * 2**20], "error": None,
            "wire_tx_bytes_per_step": None}


def _fake_methods(monkeypatch, second):
    """The first method finishes at once; the second runs ``second(network)``."""
    calls = []

    def run_method(network, method, cfg, opts, workdir, index, log):
        calls.append((network, workdir))
        if index == 1:
            second(network)
        return {}

    monkeypatch.setattr(race, "run_method", run_method)
    monkeypatch.setattr(race, "method_record", _record)
    return calls


# -- 1. teardown under a second signal ------------------------------------------------------------------------


@NEEDS_NETNS
@pytest.mark.usefixtures("no_leftovers")
def test_a_double_sigterm_during_teardown_leaves_nothing(monkeypatch, tmp_path, capsys):
    real = netns._kill_and_delete

    def signalled(names):  # two more SIGTERMs arrive while the namespaces are being deleted
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        return real(names)

    def first_sigterm(network):
        monkeypatch.setattr(netns, "_kill_and_delete", signalled)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not interrupt the race")

    calls = _fake_methods(monkeypatch, first_sigterm)
    handler = signal.getsignal(signal.SIGTERM)
    code = cli.main(_args(tmp_path / "out", link="100mbit"))
    err = capsys.readouterr().err
    network, workdir = calls[0]
    assert code == 130 and not network.exists() and network._made == []
    assert "the emulated network removed" in err and "--cleanup" not in err.split("interrupted")[1]
    assert os.path.basename(workdir).startswith(f"gradcomp-race-{network.tag}-")  # what --cleanup TAG finds
    assert signal.getsignal(signal.SIGTERM) == handler


@NEEDS_NETNS
@pytest.mark.usefixtures("no_leftovers")
def test_an_interrupted_race_that_left_its_network_says_how_to_remove_it(monkeypatch, tmp_path, capsys):
    def interrupt(network):
        monkeypatch.setattr(netns, "_kill_and_delete", lambda names: [])  # a teardown that deleted nothing
        raise KeyboardInterrupt

    calls = _fake_methods(monkeypatch, interrupt)
    code = cli.main(_args(tmp_path / "out", link="100mbit"))
    err = capsys.readouterr().err
    network = calls[0][0]
    try:
        assert code in (2, 130) and network.exists()
        assert "removed" not in err and f"`gradcomp race --cleanup {network.tag}`" in err
        said = []
        command.report_interruption({"network": network}, None, said.append)
        assert said == [f"gradcomp race: interrupted; the emulated network was not removed completely: remove it "
                        f"with `gradcomp race --cleanup {network.tag}`"]
    finally:
        monkeypatch.undo()
        netns.cleanup(network.tag)


@NEEDS_NETNS
@pytest.mark.usefixtures("no_leftovers")
def test_down_forgets_a_namespace_only_once_it_is_gone(monkeypatch):
    net = netns.NamespaceNetwork(2, None)
    net.up()
    real = netns._kill_and_delete
    monkeypatch.setattr(netns, "_kill_and_delete", lambda names: real(names[:1]))  # only the last host goes
    with pytest.raises(netns.EmulationError, match=f"--cleanup {net.tag}"):
        net.down()
    assert net._made == net.namespaces[:-1]  # the rest is still there, and still known
    monkeypatch.undo()
    net.down()
    assert not net.exists() and net._made == []


def test_signals_held_are_delivered_afterwards():
    received = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: received.append(signum))
    try:
        with netns.signals_held():
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
            assert received == []
        assert received == [signal.SIGHUP]
    finally:
        signal.signal(signal.SIGHUP, previous)


# -- 2. exit status -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_failed_method_makes_the_exit_status_1(monkeypatch, tmp_path, capsys):
    crash_at(monkeypatch, 1)  # rank 1 of every method fails at step 1
    argv = _args(tmp_path / "out")
    argv[argv.index("qsgd") - 1: argv.index("qsgd") + 1] = []  # one method
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "1 of 1 methods failed: torch-fp32" in captured.err and "| torch-fp32 | failed:" in captured.out


# -- 3. results kept, --out checked first ---------------------------------------------------------------------


def test_an_interrupted_race_keeps_its_finished_methods(monkeypatch, tmp_path, capsys):
    def interrupt(network):
        raise KeyboardInterrupt

    _fake_methods(monkeypatch, interrupt)
    out = tmp_path / "out"
    (out).mkdir()
    (out / "race.png").write_bytes(b"an earlier race's plot")
    code = cli.main(_args(out))
    err = capsys.readouterr().err
    assert code == 130 and f"the methods that finished (1) are in {out / 'race.json'}" in err
    saved = json.loads((out / "race.json").read_text())
    assert saved["complete"] is False and [m["label"] for m in saved["methods"]] == ["torch-fp32"]
    assert (out / "race.md").read_text() == saved["table"] and "| torch-fp32 |" in saved["table"]
    assert not (out / "race.png").exists()  # not beside this race's table


def test_the_table_is_printed_before_the_files_are_written(monkeypatch, tmp_path, capsys):
    _fake_methods(monkeypatch, lambda network: None)
    real = race.write_outputs

    def full_disk(out_dir, result, title, log=print, plot=True):
        if plot:  # the final write
            raise OSError(28, "No space left on device")
        return real(out_dir, result, title, log, plot)

    monkeypatch.setattr(race, "write_outputs", full_disk)
    out = tmp_path / "out"
    code = cli.main(_args(out))
    captured = capsys.readouterr()
    assert code == 2 and "| torch-fp32 |" in captured.out and "| qsgd |" in captured.out
    assert f"--out {out}: could not write the results" in captured.err and "printed above" in captured.err
    assert len(json.loads((out / "race.json").read_text())["methods"]) == 2  # saved after each method


def _unwritable_dir(path):
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        return lambda: path.chmod(0o755)
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("as root, an unwritable directory needs chattr +i, which failed here")
    return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)


def test_an_unwritable_out_is_refused_before_anything_starts(monkeypatch, tmp_path, capsys):
    started = []
    monkeypatch.setattr(race, "run_method", lambda *args: started.append(args))
    monkeypatch.setattr(netns.LocalHosts, "up", lambda self: started.append(self))
    out = tmp_path / "ro"
    restore = _unwritable_dir(out)
    try:
        code = cli.main(_args(out))
    finally:
        restore()
    err = capsys.readouterr().err
    assert code == 2 and f"--out {out}: cannot be written" in err and "nothing was started" in err
    assert not started and not list(out.iterdir())


# -- 5, 7, 8. the burst warning, the option checks, --cleanup's work directories ------------------------------


def test_a_run_of_few_bytes_warns_about_tbf_s_burst():
    record = {"label": "m", "steps": 50, "wire_tx_bytes_per_step": 10_000}  # 0.5 MB: 2 bursts
    assert "tbf's burst (256kb)" in race.burst_warning(record, 100e6)
    assert race.burst_warning(dict(record, wire_tx_bytes_per_step=200_000), 100e6) is None  # 10 MB
    assert race.burst_warning(record, None) is None  # unshaped: no bucket


def test_link_and_hosts_are_checked_with_the_option_s_name():
    assert race.link_rate("100gbit") == 100e9
    for bad in ("1e12gbit", "1tbit", "500bit"):
        with pytest.raises(ConfigError, match=r"--link must lie between 1kbit and 100gbit"):
            race.link_rate(bad)
    opts = race.Options(methods=[race.parse_method("torch-fp32")], hosts=251, dataset="synthetic", model="mlp",
                        out=None)
    with pytest.raises(ConfigError, match=r"--hosts must be between 1 and 250, got 251"):
        race.plan(opts)
    opts.hosts, opts.link = 2, "1e12gbit"
    with pytest.raises(ConfigError, match="--link"):
        race.plan(opts)


def test_cleanup_removes_the_run_s_work_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = tmp_path / "gradcomp-race-gc99991-abc"
    other = tmp_path / "gradcomp-race-gc999912-abc"
    unrelated = tmp_path / "gradcomp-race-notes"
    for d in (mine, other, unrelated):
        d.mkdir()
    assert race.remove_workdirs("gc99991") == [str(mine)] and not mine.exists() and other.exists()
    assert race.remove_workdirs("all") == [str(other)] and unrelated.exists()


@NEEDS_NETNS
@pytest.mark.usefixtures("no_leftovers")
def test_cleanup_command_names_the_work_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "gradcomp-race-gc99992-xyz").mkdir()
    assert cli.main(["race", "--cleanup", "gc99992"]) == 0
    assert "work directories: " + str(tmp_path / "gradcomp-race-gc99992-xyz") in capsys.readouterr().out
