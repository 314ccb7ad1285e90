"""Tests for the compressor registry: gradcomp.make, available, register, parse_param_strings."""

from __future__ import annotations

import math

import pytest

import gradcomp
from gradcomp import ConfigError, ErrorFeedback
from gradcomp.compressors import BFloat16, Compressor, Float16, NoCompression, RandomK, Threshold, TopK
from gradcomp.registry import compressor_class, parse_param_strings, register

BUILTIN = {
    "none": NoCompression,
    "fp16": Float16,
    "bf16": BFloat16,
    "topk": TopK,
    "randomk": RandomK,
    "threshold": Threshold,
}


def test_available_lists_the_builtins():
    names = gradcomp.available()
    assert names == sorted(names)
    assert set(BUILTIN) <= set(names)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_make_builds_the_registered_class(name):
    c = gradcomp.make(name)
    assert type(c) is BUILTIN[name]
    assert c.name == name
    assert compressor_class(name) is BUILTIN[name]
    assert isinstance(c, Compressor)


def test_default_parameters():
    assert gradcomp.make("topk").params() == {"density": 0.01, "positions": "fixed"}
    assert gradcomp.make("randomk").params() == {"density": 0.01, "scale": False, "seed": 0}
    assert gradcomp.make("threshold").params() == {"threshold": 1e-3, "positions": "fixed"}
    for name in ("none", "fp16", "bf16"):
        assert gradcomp.make(name).params() == {}


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        (["density=0.01"], {"density": 0.01}),
        (["density=1e-3"], {"density": 1e-3}),
        (["density=1"], {"density": 1}),
        (["seed=42"], {"seed": 42}),
        (["seed=-3"], {"seed": -3}),
        (["scale=true"], {"scale": True}),
        (["scale=True"], {"scale": True}),
        (["scale=yes"], {"scale": True}),
        (["scale=on"], {"scale": True}),
        (["scale=false"], {"scale": False}),
        (["scale=FALSE"], {"scale": False}),
        (["scale=no"], {"scale": False}),
        (["scale=off"], {"scale": False}),
        (["x=none"], {"x": None}),
        (["positions=golomb"], {"positions": "golomb"}),
        (["name=a=b"], {"name": "a=b"}),  # only the first '=' splits
        (["  density = 0.5 "], {"density": 0.5}),
        (["error-feedback=true"], {"error_feedback": True}),  # CLI dashes become underscores
        (["a=1", "b=2.5", "c=x", "d=off"], {"a": 1, "b": 2.5, "c": "x", "d": False}),
        ([], {}),
    ],
)
def test_parse_param_strings(items, expected):
    got = parse_param_strings(items)
    assert got == expected
    for k, v in expected.items():
        assert type(got[k]) is type(v), k  # 1 stays an int, 1.0 a float, True a bool


def test_parse_param_strings_keeps_types_apart():
    got = parse_param_strings(["i=7", "f=7.0", "b=true", "s=seven"])
    assert isinstance(got["i"], int) and not isinstance(got["i"], bool)
    assert isinstance(got["f"], float)
    assert got["b"] is True
    assert got["s"] == "seven"
    nan = parse_param_strings(["x=nan"])["x"]
    assert isinstance(nan, float) and math.isnan(nan)


@pytest.mark.parametrize("item", ["density", "", "=0.1", "1x=2", "a b=1", "a.b=1", "den$ity=1", " =3"])
def test_parse_param_strings_rejects_bad_items(item):
    with pytest.raises(ConfigError):
        parse_param_strings([item])


@pytest.mark.parametrize("items", [["a=1", "a=2"], ["a=1", "a=1"], ["error-feedback=true", "error_feedback=false"]])
def test_parse_param_strings_refuses_a_key_given_twice(items):
    # the second value used to win silently: --param density=0.01 ... --param density=0.1 ran at 0.1
    with pytest.raises(ConfigError, match="given twice"):
        parse_param_strings(items)
    with pytest.raises(ConfigError, match="--server-param .* given twice"):
        parse_param_strings(items, "--server-param")


@pytest.mark.parametrize(
    ("name", "strings", "kwargs"),
    [
        ("topk", ["density=0.05", "positions=golomb"], {"density": 0.05, "positions": "golomb"}),
        ("topk", ["density=1"], {"density": 1.0}),
        ("randomk", ["density=0.2", "scale=true", "seed=9"], {"density": 0.2, "scale": True, "seed": 9}),
        ("randomk", ["scale=off"], {"scale": False}),
        ("threshold", ["threshold=0.25"], {"threshold": 0.25}),
        ("threshold", ["threshold=1"], {"threshold": 1.0}),
        ("none", [], {}),
        ("fp16", [], {}),
        ("bf16", [], {}),
    ],
)
def test_make_from_strings_equals_the_python_call(name, strings, kwargs):
    from_cli = gradcomp.make(name, **parse_param_strings(strings))
    from_python = gradcomp.make(name, **kwargs)
    assert type(from_cli) is type(from_python)
    assert from_cli.params() == from_python.params()
    direct = BUILTIN[name](**kwargs)
    assert direct.params() == from_python.params()
    assert repr(from_cli) == repr(from_python)


def test_make_from_strings_with_error_feedback():
    c = gradcomp.make("topk", **parse_param_strings(["density=0.1", "error-feedback=yes"]))
    assert isinstance(c, ErrorFeedback)
    assert c.params() == gradcomp.make("topk", density=0.1, error_feedback=True).params()


def test_bad_values_from_strings_raise_config_error():
    with pytest.raises(ConfigError):
        gradcomp.make("topk", **parse_param_strings(["density=0"]))
    with pytest.raises(ConfigError):
        gradcomp.make("topk", **parse_param_strings(["density=lots"]))
    with pytest.raises(ConfigError):
        gradcomp.make("topk", **parse_param_strings(["positions=zip"]))
    with pytest.raises(ConfigError, match="either density or k"):
        gradcomp.make("topk", **parse_param_strings(["k=10", "density=0.1"]))
    with pytest.raises(ConfigError, match="k must be >= 1"):
        gradcomp.make("topk", **parse_param_strings(["k=0"]))
    with pytest.raises(ConfigError):
        gradcomp.make("threshold", **parse_param_strings(["threshold=-1"]))


def test_unknown_name_lists_the_available_ones():
    with pytest.raises(ConfigError) as info:
        gradcomp.make("powersgd-ish")
    for name in BUILTIN:
        assert name in str(info.value)


def test_unknown_parameter_is_named():
    with pytest.raises(ConfigError, match="sparsity"):
        gradcomp.make("topk", sparsity=0.9)


def test_register_rejects_a_second_class_under_a_taken_name():
    class Impostor(TopK):
        name = "topk"

    with pytest.raises(TypeError):
        register(Impostor)
    assert compressor_class("topk") is TopK
    assert register(TopK) is TopK  # registering the same class again is harmless


def test_register_rejects_a_class_without_name():
    class Nameless(Compressor):
        def specs(self, slot):
            return []

        def compress(self, x, slot, step):
            return []

        def decompress(self, fields, slot, step):
            raise NotImplementedError

    with pytest.raises(TypeError):
        register(Nameless)


def test_unknown_parameter_of_a_parameterless_compressor_says_none():
    with pytest.raises(ConfigError) as info:
        gradcomp.make("fp16", density=0.1)
    assert "args" not in str(info.value)
    assert "(none)" in str(info.value)


# ------------------------------------------------------------------ one table of built-ins, plugins by entry point


def _method_classes() -> dict[str, type]:
    """Every class with a ``name`` defined in gradcomp's compressors/ and schemes/ modules, by name."""
    import importlib
    import pkgutil

    import gradcomp.compressors
    import gradcomp.schemes
    from gradcomp.schemes.base import Scheme

    found: dict[str, type] = {}
    for package in (gradcomp.compressors, gradcomp.schemes):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                ours = isinstance(obj, type) and obj.__module__ == module.__name__
                if ours and issubclass(obj, (Compressor, Scheme)) and obj.__dict__.get("name"):
                    found[obj.__dict__["name"]] = obj
    return found


def test_the_builtin_table_names_every_method_class_once():
    from gradcomp import registry

    classes = _method_classes()
    for name, target in registry.BUILTIN.items():
        module, attr = target.split(":")
        cls = compressor_class(name)
        assert (cls.__module__, cls.__qualname__, cls.name) == (module, attr, name)
    # a class that sets a name but is not in the table would be unreachable: the table is the one place
    # (SingleRound and Sharded carry any compressor over a topology: GradientExchange builds them, by no name)
    unlisted = sorted(set(classes) - set(registry.BUILTIN) - {"single-round", "sharded"})
    assert not unlisted, f"method classes missing from registry.BUILTIN: {unlisted}"
    assert len(set(registry.BUILTIN.values())) == len(registry.BUILTIN)


def test_builtins_are_imported_when_first_asked_for():
    """Importing gradcomp registers nothing by side effect, and make() imports only the asked method's module."""
    import subprocess
    import sys

    code = (
        "import sys, gradcomp\n"
        "assert 'gradcomp.schemes.lgc' not in sys.modules and 'gradcomp.compressors.qsgd' not in sys.modules\n"
        "gradcomp.make('qsgd')\n"
        "assert 'gradcomp.compressors.qsgd' in sys.modules and 'gradcomp.schemes.lgc' not in sys.modules\n"
        "assert 'lgc' in gradcomp.available() and 'gradcomp.schemes.lgc' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _entry_point(name: str, value: str):
    from importlib.metadata import EntryPoint

    from gradcomp.registry import ENTRY_POINT_GROUP

    return EntryPoint(name, value, ENTRY_POINT_GROUP)


@pytest.fixture
def plugins(monkeypatch):
    """Replace the installed packages' entry points of the group by the ones a test gives."""
    from gradcomp import registry

    monkeypatch.setattr(registry, "_warned", set())  # warnings already given in this process forgotten

    def install(*eps):
        monkeypatch.setattr(registry, "_entry_points", lambda: tuple(eps))

    return install


def _list_output(capsys) -> tuple[dict[str, str], str]:
    """``gradcomp list``'s rows by name, and its stderr; the command must succeed."""
    from gradcomp.cli import main

    assert main(["list"]) == 0
    captured = capsys.readouterr()
    return {line.split()[0]: line for line in captured.out.splitlines()}, captured.err


def test_a_plugin_that_fails_to_load_is_a_clear_error(plugins, capsys):
    plugins(_entry_point("topk_again", "tests_plugin_fixture:TopKAgain"))  # a module that is not on the path
    assert "topk_again" in gradcomp.available()
    with pytest.raises(ConfigError, match="failed to load: ModuleNotFoundError"):
        gradcomp.make("topk_again")
    rows, err = _list_output(capsys)  # the other methods are listed, the broken one reported
    assert "broken" in rows["topk_again"] and "summable" in rows["fp16"] and len(rows) == len(gradcomp.available())
    assert "gradcomp: warning: plugin method 'topk_again'" in err and "tests_plugin_fixture:TopKAgain" in err
    assert "Traceback" not in err
    assert type(gradcomp.make("topk")) is TopK  # a broken plugin does not break the other methods


# what a broken plugin's module holds (the entry point names its class X), and what its error says
BROKEN_PLUGINS = {
    "import_error": ("import tests_no_such_module_xyz\n", "ModuleNotFoundError"),
    "raises": ("raise RuntimeError('boom at import')\n", "RuntimeError: boom at import"),
    "syntax": ("def (\n", "SyntaxError"),
    "exits": ("import sys\nsys.exit(3)\n", "SystemExit: 3"),  # SystemExit is no Exception: caught all the same
    "not_a_method": ("class X:\n    name = 'broken_not_a_method'\n", "not a gradcomp Compressor or Scheme class"),
    "misnamed": ("from gradcomp.compressors import TopK\nclass X(TopK):\n    name = 'other'\n", "named 'other'"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN_PLUGINS))
def test_a_broken_plugin_is_reported_and_every_other_method_still_works(kind, plugins, tmp_path, monkeypatch,
                                                                         capsys):
    from gradcomp.cli import main

    source, error = BROKEN_PLUGINS[kind]
    module, name = f"tests_broken_plugin_{kind}", f"broken_{kind}"
    (tmp_path / f"{module}.py").write_text(source)
    (tmp_path / "tests_good_plugin.py").write_text(
        "from gradcomp.compressors import TopK\nclass Good(TopK):\n    name = 'good_plugin'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins(_entry_point(name, f"{module}:X"), _entry_point("good_plugin", "tests_good_plugin:Good"))
    rows, err = _list_output(capsys)
    assert set(rows) == set(gradcomp.available()) and {"topk", "powersgd", "good_plugin", name} <= set(rows)
    assert "broken" in rows[name] and "broken" not in rows["good_plugin"]
    assert f"gradcomp: warning: plugin method {name!r}" in err and f"{module}:X" in err and error in err
    assert "Traceback" not in err
    with pytest.raises(ConfigError, match=error):  # asked for by name, it is still refused
        gradcomp.make(name)
    assert type(gradcomp.make("topk")) is TopK and gradcomp.make("good_plugin").name == "good_plugin"
    train = ["train", "--simulate", "--no-progress", "--dataset", "synthetic", "--model", "mlp", "--steps", "1"]
    assert main([*train, "--compressor", name]) == 2
    assert "gradcomp: error: plugin method" in capsys.readouterr().err


def test_a_plugin_loads_from_its_module(plugins, tmp_path, monkeypatch):
    (tmp_path / "tests_plugin_fixture.py").write_text(
        "from gradcomp.compressors import TopK\n"
        "class TopKAgain(TopK):\n    name = 'topk_again'\n"
        "class Misnamed(TopK):\n    name = 'other'\n"
        "NOT_A_CLASS = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins(_entry_point("topk_again", "tests_plugin_fixture:TopKAgain"),
            _entry_point("misnamed", "tests_plugin_fixture:Misnamed"),
            _entry_point("number", "tests_plugin_fixture:NOT_A_CLASS"))
    c = gradcomp.make("topk_again", density=0.5)
    assert type(c).__name__ == "TopKAgain" and c.params()["density"] == 0.5
    with pytest.raises(ConfigError, match="named 'other'"):
        gradcomp.make("misnamed")
    with pytest.raises(ConfigError, match="not a gradcomp Compressor or Scheme class"):
        gradcomp.make("number")


def test_a_plugin_with_a_builtin_name_is_ignored_with_a_warning(plugins, tmp_path, monkeypatch, capsys):
    from gradcomp.registry import PluginWarning

    (tmp_path / "tests_clash_plugin.py").write_text(
        "from gradcomp.compressors import TopK\nclass TopK2(TopK):\n    name = 'topk'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins(_entry_point("topk", "tests_clash_plugin:TopK2"))
    with pytest.warns(PluginWarning, match=r"ignoring plugin method 'topk' from .*tests_clash_plugin:TopK2.*"
                                           r"the built-in one wins"):
        assert type(gradcomp.make("fp16")) is Float16  # whichever name is asked for: the warning, no error
    assert type(gradcomp.make("topk")) is TopK  # the built-in
    assert gradcomp.available().count("topk") == 1 and gradcomp.registry.origin("topk") == "built-in"
    # warned once already: the list says it again (it forgets what was said)
    rows, err = _list_output(capsys)
    assert "plugin" not in rows["topk"] and "summable" in rows["fp16"]
    assert "gradcomp: warning: ignoring plugin method 'topk'" in err and "Traceback" not in err


def test_two_plugins_of_one_name_break_that_name_only(plugins, capsys):
    plugins(_entry_point("mine", "one:Mine"), _entry_point("mine", "two:Mine"))
    assert gradcomp.available().count("mine") == 1
    with pytest.raises(ConfigError, match="two plugins name a method 'mine'.*one:Mine.*two:Mine"):
        gradcomp.make("mine")  # which class the name means is in doubt: neither
    assert type(gradcomp.make("fp16")) is Float16
    rows, err = _list_output(capsys)
    assert "broken" in rows["mine"] and "gradcomp: warning: two plugins name a method 'mine'" in err


def test_register_at_run_time_and_its_clashes():
    from gradcomp import registry

    class Mine(TopK):
        name = "mine_at_run_time"

    try:
        assert register(Mine) is Mine and gradcomp.make("mine_at_run_time").name == "mine_at_run_time"
        assert registry.origin("mine_at_run_time") == "registered"

        class Other(TopK):
            name = "mine_at_run_time"

        with pytest.raises(TypeError, match="taken"):
            register(Other)
        with pytest.raises(TypeError, match="neither a Compressor nor a Scheme"):
            register(type("Plain", (), {"name": "plain"}))
    finally:
        registry._REGISTERED.pop("mine_at_run_time", None)


def test_a_left_out_plugin_is_one_warning_line_in_any_command(tmp_path):
    """Outside `gradcomp list` the warning came in Python's "file:line: PluginWarning: ..." form; every command
    now tells it as one "gradcomp: warning:" line, as it tells its errors. A real (fake) distribution on the path."""
    import os
    import subprocess
    import sys

    info = tmp_path / "fakeplug_clash-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplug-clash\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[gradcomp.methods]\ntopk = fp_clash:TopK2\n")
    (tmp_path / "fp_clash.py").write_text(
        "from gradcomp.compressors import TopK\nclass TopK2(TopK):\n    name = 'topk'\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "gradcomp.cli", "train", "--simulate", "--workers", "2", "--steps",
                           "1", "--dataset", "synthetic", "--model", "mlp", "--no-progress", "--compressor", "topk"],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gradcomp: warning: ignoring plugin method 'topk'" in done.stderr, done.stderr
    assert "PluginWarning" not in done.stderr and done.stderr.count("ignoring plugin method") == 1, done.stderr
