"""The static lazy-import check on a fixture tree of planted violations and near-misses, the policy
table, and the CLI under ``python3 -S`` (what a bare runner has)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.lazy_imports.policy import Policy, PolicyError, load_policy, parse_policy
from mizzen_ci.lazy_imports.static import check_static

# It checks the real workspace (every module, in a subprocess): no import of its own shows them.
register_cpu_ci(est_time=10, labels=["ci"], watches=["packages/*/src/**/*.py"])

PACKAGES = [
    "direct", "deep", "parentinit", "relative", "fromsub", "lazyok", "dyn", "guarded", "prefix",
    "cycle", "cyclean", "lenient", "strict_budget", "std_only",
]  # fmt: skip

# Every module of the fixture whose import loads something its budget forbids, with its chain.
EXPECTED = {
    "direct.model": ["src/direct/model.py:4 imports sglang (module scope)"],
    "deep.a": [
        "src/deep/a.py:3 imports deep.b (module scope)",
        "src/deep/b.py:3 imports deep.c (module scope)",
        "src/deep/c.py:3 imports sglang.srt (module scope)",
    ],
    "deep.b": [
        "src/deep/b.py:3 imports deep.c (module scope)",
        "src/deep/c.py:3 imports sglang.srt (module scope)",
    ],
    "deep.c": ["src/deep/c.py:3 imports sglang.srt (module scope)"],
    "parentinit.sub": ["src/parentinit/sub/__init__.py:1 imports flash_attn (module scope)"],
    "parentinit.user": [
        "src/parentinit/user.py:1 imports parentinit.sub (module scope, parent package of "
        "parentinit.sub.leaf, its __init__ runs first)",
        "src/parentinit/sub/__init__.py:1 imports flash_attn (module scope)",
    ],
    "relative.x.sibling": ["src/relative/x/sibling.py:1 imports sglang (module scope)"],
    "relative.x.y": [
        "src/relative/x/y/__init__.py:1 imports relative.x.y.deep (module scope)",
        "src/relative/x/y/deep.py:2 imports relative.x.sibling (module scope)",
        "src/relative/x/sibling.py:1 imports sglang (module scope)",
    ],
    "relative.x.y.deep": [
        "src/relative/x/y/deep.py:2 imports relative.x.sibling (module scope)",
        "src/relative/x/sibling.py:1 imports sglang (module scope)",
    ],
    "fromsub.heavy_model": [
        "src/fromsub/heavy_model.py:1 imports megatron.bridge.models (module scope)"
    ],
    "fromsub.registry": [
        "src/fromsub/registry.py:1 imports fromsub.heavy_model (module scope)",
        "src/fromsub/heavy_model.py:1 imports megatron.bridge.models (module scope)",
    ],
    "dyn.loader": [
        "src/dyn/loader.py:3 imports sglang.srt.entrypoints (module scope, importlib.import_module)"
    ],
    "dyn.dunder": ["src/dyn/dunder.py:1 imports flash_attn (module scope, __import__)"],
    "guarded.opt": [
        "src/guarded/opt.py:2 imports flash_attn (module scope, guarded by try/except ImportError)"
    ],
    "prefix.bad": ["src/prefix/bad.py:1 imports megatron.bridge (module scope)"],
    "prefix.bad_deep": [
        "src/prefix/bad_deep.py:1 imports megatron.bridge.models.gpt (module scope)"
    ],
    "cycle.a": [
        "src/cycle/a.py:1 imports cycle.b (module scope)",
        "src/cycle/b.py:2 imports sglang (module scope)",
    ],
    "cycle.b": ["src/cycle/b.py:2 imports sglang (module scope)"],
    "strict_budget.bridge": [
        "src/strict_budget/bridge.py:1 imports lenient.model (module scope)",
        "src/lenient/model.py:1 imports torch (module scope)",
    ],
    "std_only.tool": ["src/std_only/tool.py:1 imports yaml (module scope)"],
    "lazyok.consumer": [
        "src/lazyok/consumer.py:1 imports kernel from lazyok (module scope; a name lazyok does "
        "not bind, so its module __getattr__ runs)",
        "src/lazyok/__init__.py:16 imports flash_attn (inside module __getattr__, run by the "
        "import above)",
    ],
}


@pytest.fixture(scope="module")
def static_tree(ci_fixtures: Path) -> Path:
    return ci_fixtures / "lazy_imports" / "static"


@pytest.fixture(scope="module")
def report(static_tree: Path):
    return check_static(
        static_tree, [static_tree / "src"], PACKAGES, load_policy(static_tree / "pyproject.toml")
    )


def test_every_planted_violation_with_its_exact_chain(report):
    got = {v.module: v.lines() for v in report.violations}
    assert got == EXPECTED


def test_near_misses_are_clean(report):
    flagged = {v.module for v in report.violations}
    clean = {
        "lazyok",  # TYPE_CHECKING imports, PEP 562 __getattr__
        "lazyok.funcs",  # function and method bodies, typing.TYPE_CHECKING
        "lazyok.bound_consumer",  # names lazyok binds: its __getattr__ never runs
        "prefix.ok",  # megatron.core and megatron_bridge are not megatron.bridge
        "dyn.computed",  # a computed importlib name is invisible statically (runtime test)
        "parentinit.sub.leaf",  # its own parent is dirty, reported once as parentinit.sub
        "cyclean.a",  # a cycle, nothing forbidden
        "cyclean.b",
        "lenient.model",  # torch is fine for lenient, only strict_budget forbids it
        "strict_budget.lazy_torch",
        "std_only",  # __future__, json and os.path are stdlib
        "std_only.lazy",  # pytest only inside a function
    }
    assert clean <= {m for modules in report.packages.values() for m in modules}
    assert not clean & flagged
    assert "std_only.__main__" not in report.packages["std_only"]  # entry points are not walked


def test_violations_are_grouped_by_offending_line_longest_chain_first(report):
    groups = {(v.last.file, v.last.line): (v.module, others) for v, others in report.groups()}
    assert groups[("src/deep/c.py", 3)] == ("deep.a", ["deep.b", "deep.c"])
    assert groups[("src/parentinit/sub/__init__.py", 1)] == ("parentinit.user", ["parentinit.sub"])
    assert len(groups) == 14


def test_unparsable_relative_import_is_a_problem(report):
    assert [str(p) for p in report.problems] == [
        "src/relative/broken.py:1: relative import `from .... import nowhere` reaches beyond "
        "package relative"
    ]
    assert not report.ok


def test_budget_prefix_matching_by_dotted_components():
    policy = parse_policy(
        {"gpu-only": ["megatron.bridge", "triton"], "packages": {"p": {"forbid": ["torch"]}}}, "t"
    )
    b = policy.budget("p")
    assert b.violated_by("megatron.bridge").module == "megatron.bridge"
    assert b.violated_by("megatron.bridge.models.x").origin == "gpu-only"
    for ok in ("megatron", "megatron.core", "megatron_bridge", "megatron.bridged", "tritonclient"):
        assert b.violated_by(ok) is None, ok
    assert b.violated_by("torch.nn").origin == "forbid"
    assert policy.budget("other").violated_by("torch") is None
    std = parse_policy({"packages": {"tool": {"stdlib-only": True}}}, "t").budget("tool")
    assert std.violated_by("json") is None and std.violated_by("tool.sub") is None
    assert std.violated_by("yaml.loader").module == "yaml"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"gpu-only": "sglang"}, "gpu-only must be a list of module names"),
        ({"gpu-only": ["sg-lang"]}, "'sg-lang' is not a dotted module name"),
        ({"gpu-only": ["a", "a"]}, "lists ['a'] twice"),
        ({"forbidden": []}, "unknown key(s) ['forbidden']"),
        ({"packages": {"p": {"stdlib_only": True}}}, "unknown key(s) ['stdlib_only']"),
        ({"gpu-only": ["x"], "packages": {"p": {"forbid": ["x"]}}}, "repeats ['x'] from gpu-only"),
        ({"gpu-only": ["x"], "tolerated": {"y": ["lib"]}}, "y is not forbidden anywhere"),
    ],
)
def test_policy_errors_say_where_and_how_to_fix(table, message):
    with pytest.raises(PolicyError) as e:
        parse_policy(table, "pyproject.toml")
    assert message in str(e.value) and "Fix" in str(e.value)


def test_the_repository_policy_is_valid_and_covers_the_issue_list(repo_root):
    policy = load_policy(repo_root / "pyproject.toml")
    for m in (
        "sglang", "sgl_kernel", "flash_attn", "flashinfer", "transformer_engine", "apex",
        "deep_ep", "triton", "megatron.bridge", "mamba_ssm", "causal_conv1d", "tilelang", "vllm",
    ):  # fmt: skip
        assert m in policy.gpu_only, m
    assert policy.budget("mizzen_ci").stdlib_only
    assert set(policy.budget("mizzen_rollout").forbidden) >= {
        "torch",
        "ray",
        "harbor",
        "transformers",
    }
    assert policy.budget("mizzen_train").violated_by("megatron.core") is None
    assert isinstance(policy, Policy)


# ---- the CLI, as a bare runner runs it


@pytest.fixture
def lazy_imports(mizzen_ci):
    """``mizzen-ci lazy-imports ARGS`` under ``python3 -S``."""

    def run(*args: str, **options):
        return mizzen_ci("lazy-imports", *args, timeout=120, **options)

    return run


def test_cli_static_on_the_repository_is_clean(lazy_imports):
    out = lazy_imports("--static")
    assert out.returncode == 0, out.stderr
    assert "mizzen_ci, mizzen_plugins, mizzen_rollout, mizzen_train) clean" in out.stdout


def test_cli_prints_chains_one_hop_a_line_and_annotates_under_actions(lazy_imports, static_tree):
    out = lazy_imports("--static", "--root", str(static_tree), "--package", "deep", github=True)
    assert out.returncode == 1
    assert out.stderr.splitlines()[:5] == [
        "deep.a loads sglang.srt at import time: sglang is GPU-only, forbidden at import time in "
        "every package.",
        "  src/deep/a.py:3 imports deep.b (module scope)",
        "  src/deep/b.py:3 imports deep.c (module scope)",
        "  src/deep/c.py:3 imports sglang.srt (module scope)",
        "  (the same import line is also reached from: deep.b, deep.c)",
    ]
    annotations = [ln for ln in out.stdout.splitlines() if ln.startswith("::error")]
    assert len(annotations) == 1
    assert annotations[0].startswith(
        "::error file=src/deep/c.py,line=3,title=mizzen lazy-imports (static)::deep.a loads"
    )
    assert "%0A  src/deep/a.py:3 imports deep.b" not in annotations[0]  # hops unindented there
    assert "%0Asrc/deep/a.py:3 imports deep.b (module scope)%0A" in annotations[0]


def test_cli_forbid_works_on_any_tree_without_a_policy(lazy_imports, tmp_path):
    (tmp_path / "tool").mkdir()
    (tmp_path / "tool" / "__init__.py").write_text("import os\nimport requests.adapters\n")
    no_policy = lazy_imports("--static", "--root", str(tmp_path), "--package", "tool")
    assert no_policy.returncode == 2 and "nothing is forbidden" in no_policy.stderr
    missing = lazy_imports(
        "--static", "--root", str(tmp_path), "--package", "nope", "--forbid", "x"
    )
    assert missing.returncode == 2 and "package nope not found" in missing.stderr
    (tmp_path / "src" / "tool").mkdir(parents=True)
    (tmp_path / "src" / "tool" / "__init__.py").write_text("")
    ambiguous = lazy_imports(
        "--static", "--root", str(tmp_path), "--package", "tool", "--forbid", "x"
    )
    assert ambiguous.returncode == 2 and "ambiguous" in ambiguous.stderr
    (tmp_path / "src" / "tool" / "__init__.py").unlink()
    (tmp_path / "src" / "tool").rmdir()
    out = lazy_imports(
        "--static", "--root", str(tmp_path), "--package", "tool", "--forbid", "requests"
    )
    assert out.returncode == 1
    assert "  tool/__init__.py:2 imports requests.adapters (module scope)" in out.stderr
    assert "requests is forbidden by --forbid" in out.stderr
