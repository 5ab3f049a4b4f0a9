"""The ``[parallel]`` section and the world a launch plans (``mizzen_train.run.parallel``): the
environment torchrun sets is read as hostile input, and every split rule names its field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=10, labels=["train"])

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1"}


def _parallel(**fields):
    from mizzen_train.run.parallel import ParallelConfig

    return ParallelConfig(**fields)


def test_a_direct_launch_is_one_rank_and_torchrun_sets_the_split():
    from mizzen_train.run.parallel import plan_world

    plan = plan_world(_parallel(), {})
    assert (plan.rank, plan.world_size, plan.data, plan.launched, plan.is_writer) == (
        0, 1, 1, False, True
    )  # fmt: skip
    plan = plan_world(_parallel(tensor=2, context=2), TORCHRUN)
    assert (plan.rank, plan.local_rank, plan.world_size, plan.data) == (3, 1, 8, 2)
    assert not plan.is_writer
    assert plan.describe() == {"world": 8, "tensor": 2, "context": 2, "data": 2}


@pytest.mark.parametrize(
    "env,field,words",
    [
        ({**TORCHRUN, "WORLD_SIZE": "eight"}, "WORLD_SIZE", "integer"),
        ({**TORCHRUN, "RANK": "-1"}, "RANK", "integer >= 0"),
        ({**TORCHRUN, "RANK": "8"}, "RANK", "below WORLD_SIZE"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR", "torchrun"),
    ],
)
def test_a_hostile_environment_is_a_config_error_naming_the_variable(env, field, words):
    from mizzen_train.run.config import ConfigError
    from mizzen_train.run.parallel import plan_world

    with pytest.raises(ConfigError) as caught:
        plan_world(_parallel(), env)
    assert caught.value.field == field and words in str(caught.value)


@pytest.mark.parametrize(
    "sizes,field", [({"tensor": 3}, "parallel.tensor"), ({"tensor": 2, "context": 3},
                                                          "parallel.context")]
)  # fmt: skip
def test_the_split_must_divide_the_world(sizes, field):
    from mizzen_train.run.config import ConfigError
    from mizzen_train.run.parallel import plan_world

    with pytest.raises(ConfigError) as caught:
        plan_world(_parallel(**sizes), TORCHRUN, source="run.toml")
    assert caught.value.field == field
    assert "divide the world size 8" in str(caught.value) and "run.toml" in str(caught.value)


SPEC = SimpleNamespace(num_attention_heads=4, query_groups=2, vocab_size=260, ffn_size=128)


@pytest.mark.parametrize(
    "spec,sizes,rows,seq_len,field,words",
    [
        ({"num_attention_heads": 6, "query_groups": 6}, {"tensor": 4}, 8, 64, "parallel.tensor",
         "attention heads = 6"),
        ({"query_groups": 2}, {"tensor": 4}, 8, 64, "parallel.tensor", "query groups"),
        ({"vocab_size": 259}, {"tensor": 2}, 8, 64, "parallel.tensor", "vocabulary size = 259"),
        ({"ffn_size": 129}, {"tensor": 2}, 8, 64, "parallel.tensor", "FFN width = 129"),
        ({}, {"context": 2}, 8, 66, "parallel.context", "sequence length"),
        ({}, {"tensor": 2}, 6, 64, "tenants[*].rows", "micro-batches"),
    ],
)  # fmt: skip
def test_every_split_rule_names_its_field(spec, sizes, rows, seq_len, field, words):
    from mizzen_train.run.config import ConfigError
    from mizzen_train.run.parallel import check_split, plan_world

    plan = plan_world(_parallel(**sizes), TORCHRUN)
    model = SimpleNamespace(**{**vars(SPEC), **spec})
    with pytest.raises(ConfigError) as caught:
        check_split(plan, model, rows=rows, seq_len=seq_len, micro_batch_size=1, source="",
                    context_supported=True)  # fmt: skip
    assert caught.value.field == field and words in str(caught.value)
    fitting = plan_world(_parallel(tensor=2, context=sizes.get("context", 1)), TORCHRUN)
    check_split(
        fitting, SPEC, rows=16, seq_len=64, micro_batch_size=2, source="", context_supported=True
    )  # fmt: skip  (a split that fits passes)


def test_context_parallel_is_refused_until_the_attention_splits_sequences():
    from mizzen_train.run.config import ConfigError
    from mizzen_train.run.parallel import check_split, plan_world

    plan = plan_world(_parallel(context=2), TORCHRUN)
    with pytest.raises(ConfigError, match="packed") as caught:
        check_split(plan, SPEC, rows=8, seq_len=64, micro_batch_size=1, source="",
                    context_supported=False)  # fmt: skip
    assert caught.value.field == "parallel.context"


def test_the_parallel_section_is_part_of_both_commands():
    from mizzen_train.rl.config import RlConfig
    from mizzen_train.run.config import ConfigError
    from mizzen_train.sft.config import SftConfig

    for cls in (SftConfig, RlConfig):
        assert "parallel" in cls.SECTIONS
        assert "[parallel]" in cls.help_text() or "parallel.tensor" in cls.help_text()
    base = {
        "run": {"dir": "r", "steps": 2, "checkpoint_interval": 1},
        "model": {"path": "tiny"},
        "data": {"seq_len": 32},
        "tenants": [{"name": "a", "data": "example:colours_train", "rows": 4, "lr": 1e-3}],
    }
    assert SftConfig.parse(base).parallel.tensor == 1  # defaulted when absent
    with pytest.raises(ConfigError) as caught:
        SftConfig.parse({**base, "parallel": {"tensor": 0}})
    assert caught.value.field == "parallel.tensor"


def test_the_shipped_parallel_example_fits_four_ranks():
    from mizzen_train.run.parallel import check_split, plan_world
    from mizzen_train.sft.config import SftConfig

    config = SftConfig.load("example:sft_tiny_parallel")
    assert (config.parallel.tensor, config.parallel.context, config.run.threads) == (2, 1, 1)
    plan = plan_world(config.parallel, {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "4"})
    assert plan.data == 2
    from mizzen_train.hf.tiny import tiny_llama_config

    tiny = tiny_llama_config(**{k: v for k, v in config.model.tiny.items() if k != "seed"})
    spec = SimpleNamespace(
        num_attention_heads=tiny["num_attention_heads"], query_groups=tiny["num_key_value_heads"],
        ffn_size=tiny["intermediate_size"], vocab_size=tiny["vocab_size"],
    )  # fmt: skip
    check_split(plan, spec, rows=sum(t.rows for t in config.tenants),
                seq_len=config.data.seq_len, micro_batch_size=config.run.micro_batch_size,
                source=config.source, context_supported=False)  # fmt: skip


def test_every_rl_step_must_split_over_the_data_parallel_ranks():
    """RL's rows change as tenants join and leave: every step's set of tenants is checked (the
    error names a tenant field and the step), and context parallel pads the rows' width."""
    from mizzen_train.rl.config import RlConfig
    from mizzen_train.rl.rows import padded_width
    from mizzen_train.rl.trainer import RlTrainer
    from mizzen_train.run.config import ConfigError
    from mizzen_train.run.parallel import RankWorld, plan_world

    tenant = {"data": "example:rl_fixed", "reward": "math", "lr": 1e-3, "n_samples": 4}
    config = RlConfig.parse(
        {
            "run": {"dir": "r", "steps": 6, "checkpoint_interval": 2, "micro_batch_size": 4},
            "model": {"path": "tiny"},
            "tenants": [
                {"name": "a", "prompts_per_step": 2, **tenant},
                {"name": "b", "prompts_per_step": 1, "join_step": 3, "leave_step": 4, **tenant},
            ],
        },
        source="rl.toml",
    )
    trainer = RlTrainer(config, resume=False, stream=None)
    trainer.width = 40
    trainer.world = RankWorld(plan_world(_parallel(), {**TORCHRUN, "WORLD_SIZE": "2",
                                                       "RANK": "0"}), "cpu")  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        trainer.step_rows()  # steps 1-2 and 5-6: 8 rows; steps 3-4: 12, not a multiple of 2 x 4
    assert caught.value.field == "tenants[1].prompts_per_step"  # b's 4 rows are the odd ones
    assert "step 3 trains 12 rows" in str(caught.value) and "rl.toml" in str(caught.value)
    trainer.world = RankWorld(plan_world(_parallel(), {}), "cpu")
    assert trainer.step_rows() == (12, 40)  # one rank: every step's rows fit
    assert (padded_width(37, 1), padded_width(37, 2), padded_width(40, 4)) == (37, 40, 40)
