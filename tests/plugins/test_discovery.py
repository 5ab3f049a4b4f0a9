"""Plugin discovery through the ``mizzen.plugins`` entry-point group, with real metadata.

Extra plugins come from a temporary directory on ``PYTHONPATH`` holding a real ``.dist-info``
(``METADATA`` + ``entry_points.txt``) and the plugin modules, read by the real
``importlib.metadata`` in a fresh interpreter, where ``sys.modules`` shows what was imported.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=15, labels=["plugins"])

PLUGINS_SRC = Path(__file__).resolve().parents[2] / "packages" / "plugins" / "src"

DUMMY_MODULE = """
from mizzen_plugins import ModelPlugin


class DummyConfig:
    def __init__(self, width):
        self.width = width

    @classmethod
    def from_hf_dict(cls, hf):
        return cls(hf["width"])


def build(config):
    return ("dummy model", config.width)


PLUGIN = ModelPlugin(name="dummy", family="dummy_family", config_class=DummyConfig, build=build)
"""


def write_distribution(root: Path, name: str, entry_points: dict[str, str]) -> None:
    """A minimal installed distribution: ``<name>-1.0.dist-info`` with the given plugins."""
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[mizzen.plugins]\n{lines}")


@pytest.fixture
def extra_plugins(tmp_path):
    (tmp_path / "mizzen_dummy_plugin.py").write_text(DUMMY_MODULE)
    (tmp_path / "mizzen_exploding_plugin.py").write_text(
        'raise RuntimeError("the exploding plugin module was imported")\n'
    )
    write_distribution(
        tmp_path,
        "mizzen-dummy-plugins",
        {
            "dummy": "mizzen_dummy_plugin:PLUGIN",
            "exploding": "mizzen_exploding_plugin:PLUGIN",
            "misnamed": "mizzen_dummy_plugin:PLUGIN",
            "not_a_plugin": "mizzen_dummy_plugin:build",
        },
    )
    return tmp_path


def run_python(code: str, *, pythonpath: list[Path], flags: tuple[str, ...] = ()) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    result = subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


PROBE = """
import json, sys
import mizzen_plugins

def loaded(prefixes):
    return sorted(m for m in sys.modules if m.startswith(prefixes))

def error_of(name):
    try:
        mizzen_plugins.get(name)
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return None
"""


def test_importing_mizzen_plugins_imports_no_model_module_and_not_torch():
    out = run_python(
        PROBE + "print(json.dumps(loaded(('mizzen_plugins', 'torch'))))", pythonpath=[]
    )
    assert out == ["mizzen_plugins", "mizzen_plugins.discovery"]


def test_get_loads_the_named_plugin_without_importing_the_others(extra_plugins):
    out = run_python(
        PROBE
        + """
plugin = mizzen_plugins.get("nemotron_h")
config = plugin.config_from_hf({"vocab_size": 11, "hidden_size": 8, "hybrid_override_pattern": "M-",
    "ssm_state_size": 4, "mamba_num_heads": 2, "mamba_head_dim": 4, "n_groups": 1})
model = plugin.build(config)
print(json.dumps({
    "available": mizzen_plugins.available(),
    "family": plugin.family,
    "config": type(config).__name__,
    "model": type(model).__name__,
    "others": loaded(("mizzen_dummy_plugin", "mizzen_exploding_plugin")),
    "same": mizzen_plugins.get("nemotron_h") is plugin,
}))
""",
        pythonpath=[extra_plugins],
    )
    assert out["available"] == [
        "deepseek_v4",
        "dummy",
        "exploding",
        "misnamed",
        "nemotron_h",
        "not_a_plugin",
    ]
    assert out["family"] == "nemotron_h" and out["config"] == "NemotronHConfig"
    assert out["model"] == "HybridCausalLM" and out["same"]
    assert out["others"] == []  # the exploding module would have failed the run if imported


def test_another_distributions_plugin_loads_without_the_nemotron_h_module(extra_plugins):
    out = run_python(
        PROBE
        + """
plugin = mizzen_plugins.get("dummy")
print(json.dumps({
    "family": plugin.family,
    "built": plugin.build(plugin.config_from_hf({"width": 3})),
    "loaded": loaded(("mizzen_plugins.nemotron_h", "torch", "mizzen_exploding_plugin")),
}))
""",
        pythonpath=[extra_plugins],
    )
    assert out == {"family": "dummy_family", "built": ["dummy model", 3], "loaded": []}


def test_unknown_and_broken_plugins_are_errors_that_say_why(extra_plugins):
    out = run_python(
        PROBE
        + """
print(json.dumps({n: error_of(n) for n in ("nemotron", "exploding", "misnamed", "not_a_plugin")}))
""",
        pythonpath=[extra_plugins],
    )
    kind, message = out["nemotron"]
    assert kind == "PluginNotFoundError"
    assert "no mizzen plugin named 'nemotron'" in message
    assert "nemotron_h = 'mizzen_plugins.nemotron_h.plugin:PLUGIN' from mizzen-plugins" in message
    assert "dummy = 'mizzen_dummy_plugin:PLUGIN' from mizzen-dummy-plugins 1.0" in message
    kind, message = out["exploding"]
    assert kind == "PluginLoadError"
    assert "RuntimeError: the exploding plugin module was imported" in message
    kind, message = out["misnamed"]
    assert kind == "PluginLoadError" and "loads a ModelPlugin named 'dummy'" in message
    kind, message = out["not_a_plugin"]
    assert (
        kind == "PluginLoadError"
        and "loads a function, not a mizzen_plugins.ModelPlugin" in message
    )


def test_a_name_declared_twice_is_ambiguous(tmp_path):
    write_distribution(tmp_path, "mizzen-impostor", {"nemotron_h": "impostor:PLUGIN"})
    out = run_python(PROBE + "print(json.dumps(error_of('nemotron_h')))", pythonpath=[tmp_path])
    kind, message = out
    assert kind == "PluginLoadError" and "declared by several entry points" in message
    assert "from mizzen-plugins 0.1.0" in message and "from mizzen-impostor 1.0" in message


def test_an_uninstalled_source_tree_reads_its_own_pyproject(tmp_path):
    # As on the GPU lanes: src/ on PYTHONPATH, no installed metadata (-S: no site-packages).
    out = run_python(
        PROBE
        + """
import logging
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("mizzen_plugins").addHandler(handler)
logging.getLogger("mizzen_plugins").setLevel(logging.INFO)
print(json.dumps({"available": mizzen_plugins.available(), "missing": error_of("missing"),
                  "log": records[:1]}))
""",
        pythonpath=[PLUGINS_SRC],
        flags=("-S",),
    )
    assert out["available"] == ["deepseek_v4", "nemotron_h"]
    (message,) = out["log"]
    assert message.startswith("mizzen-plugins is not installed; reading its 'mizzen.plugins'")
    assert message.endswith(str(PLUGINS_SRC.parent / "pyproject.toml"))
    assert "nemotron_h = 'mizzen_plugins.nemotron_h.plugin:PLUGIN' from source" in out["missing"][1]
