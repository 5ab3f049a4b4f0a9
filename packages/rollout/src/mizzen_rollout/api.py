"""The public API of mizzen-rollout: every name another package may import from it.

``mizzen_train`` (and any other user) imports ``from mizzen_rollout.api import ...`` and nothing
else of this package; ``tests/rollout/test_public_api.py`` fails on any other ``mizzen_rollout.*``
import from ``mizzen_train``, lazy ones inside functions included.  The modules behind these names
may move; the names here stay (a rename is a change of this file, seen in review).

The surface, by concern:

- the sample contract: :class:`Sample`, :class:`SampleGroup`, :class:`SampleStatus`,
  :class:`SampleValidationError`, :data:`SCHEMA_VERSION`, :func:`read_samples`,
  :func:`write_samples`;
- engines: :class:`Engine` (the interface), :class:`SGLangClient` (SGLang and the embedded
  server over HTTP), :class:`SamplingParams`, :class:`GenerateRequest`, :class:`GenerateResult`,
  :class:`ChatRequest`, :class:`ChatResult`, :class:`FinishReason`; the errors
  :class:`EngineError` > :class:`EngineUnavailableError`, :class:`EngineTimeoutError`,
  :class:`EngineRequestError`, :class:`EngineProtocolError`; and :data:`ENGINE_MAX_BATCH`, the
  one engine batch limit (prompts per engine call);
- launching engines: :func:`launch_embedded`, :func:`launch_sglang`, :class:`ServerProcess`,
  :class:`LaunchError`, :func:`find_free_port`;
- routing and scale-out: :class:`EngineRouter`, :class:`NoEngineAvailableError`,
  :class:`RolloutManager` (Ray), :class:`EngineSpec`;
- the rollout pipeline: :func:`run_rollout`, :class:`RolloutConfig`, :class:`RolloutBatch`,
  :class:`RolloutMetrics`, the group filters :func:`drop_groups_with_aborted` and
  :func:`drop_groups_with_failed`;
- rewards: :data:`RewardFn`, :func:`load_reward`, :class:`RewardSpecError`, :func:`score_samples`;
- the one ``module:function`` loader: :func:`load_object`, :func:`check_spec_form` (its form,
  nothing imported), :class:`ObjectSpecError` (rewards, user evaluators and advantage estimators
  resolve their specs with it);
- prompt data: :class:`PromptDataset`, :class:`PromptRecord`, :class:`DatasetKeys`,
  :class:`DataCursor`, :class:`DataError`;
- prompt rendering: :func:`render_prompt` and :data:`Prompt` (what an engine generates from; the
  trainer's evaluation and ``mizzen-rollout generate`` share it);
- LoRA adapters: :class:`AdapterRef`, :class:`AdapterConfig`, :class:`AdapterFormatError`,
  :func:`read_adapter_config`, :func:`adapter_config_dict`, the PEFT files
  :data:`ADAPTER_CONFIG_FILE` and :data:`ADAPTER_WEIGHTS_FILE`, and their weight keys
  :func:`peft_weight_key`, :func:`split_peft_weight_key`;
- the embedded engine's tiny model and byte tokenizer: :func:`load_tiny_config`,
  :func:`hf_byte_tokenizer`;
- secrets masked at the output boundary (the process-wide mask set): :func:`register_secret`,
  :func:`register_url`, :func:`register_environment`, :func:`mask`, :func:`mask_value`,
  :func:`masked_repr`, :func:`shown_line` (a text masked and escaped to one terminal line: what
  every command's error boundary prints), :func:`install_output_masks`, :func:`describe_env`,
  :func:`check_worker_env`, :data:`MIN_SECRET_LENGTH`, :class:`SecretError`,
  :class:`SecretTooShortError`;
- what every mizzen command line shares: :class:`OneLineParser` (one-line usage errors),
  :class:`HelpFormatter`, :func:`package_version` and :func:`quiet_third_party` (third-party
  warnings counted in one summary line unless ``--verbose``).

Invariant: importing this module imports no heavy library (torch, ray, transformers, harbor):
every module behind it keeps torch and friends inside functions (the lazy-import policy of the
root ``pyproject.toml``), so these are plain imports that the static import graph sees.
"""

from __future__ import annotations

from .adapters import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    AdapterConfig,
    AdapterFormatError,
    AdapterRef,
    adapter_config_dict,
    peft_weight_key,
    read_adapter_config,
    split_peft_weight_key,
)
from .cli_surface import HelpFormatter, OneLineParser, package_version, quiet_third_party
from .data import DataCursor, DataError, DatasetKeys, PromptDataset, PromptRecord
from .engines import (
    ENGINE_MAX_BATCH,
    ChatRequest,
    ChatResult,
    Engine,
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnavailableError,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    SGLangClient,
)
from .engines.embedded.backend import load_tiny_config
from .engines.embedded.tokenizer import hf_byte_tokenizer
from .engines.launcher import (
    LaunchError,
    ServerProcess,
    find_free_port,
    launch_embedded,
    launch_sglang,
)
from .loading import ObjectSpecError, check_spec_form, load_object
from .manager import EngineSpec, RolloutManager
from .masking import (
    MIN_SECRET_LENGTH,
    SecretError,
    SecretTooShortError,
    check_worker_env,
    describe_env,
    install_output_masks,
    mask,
    mask_value,
    masked_repr,
    register_environment,
    register_secret,
    register_url,
    shown_line,
)
from .metrics import RolloutMetrics
from .prompts import Prompt, render_prompt
from .rewards import RewardFn, RewardSpecError, load_reward, score_samples
from .rollout import (
    RolloutBatch,
    RolloutConfig,
    drop_groups_with_aborted,
    drop_groups_with_failed,
    run_rollout,
)
from .router import EngineRouter, NoEngineAvailableError
from .samples import (
    SCHEMA_VERSION,
    Sample,
    SampleGroup,
    SampleStatus,
    SampleValidationError,
    read_samples,
    write_samples,
)

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "ENGINE_MAX_BATCH",
    "MIN_SECRET_LENGTH",
    "SCHEMA_VERSION",
    "AdapterConfig",
    "AdapterFormatError",
    "AdapterRef",
    "ChatRequest",
    "ChatResult",
    "DataCursor",
    "DataError",
    "DatasetKeys",
    "Engine",
    "EngineError",
    "EngineProtocolError",
    "EngineRequestError",
    "EngineRouter",
    "EngineSpec",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "HelpFormatter",
    "LaunchError",
    "NoEngineAvailableError",
    "ObjectSpecError",
    "OneLineParser",
    "Prompt",
    "PromptDataset",
    "PromptRecord",
    "RewardFn",
    "RewardSpecError",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutManager",
    "RolloutMetrics",
    "SGLangClient",
    "Sample",
    "SampleGroup",
    "SampleStatus",
    "SampleValidationError",
    "SamplingParams",
    "SecretError",
    "SecretTooShortError",
    "ServerProcess",
    "adapter_config_dict",
    "check_spec_form",
    "check_worker_env",
    "describe_env",
    "drop_groups_with_aborted",
    "drop_groups_with_failed",
    "find_free_port",
    "hf_byte_tokenizer",
    "install_output_masks",
    "launch_embedded",
    "launch_sglang",
    "load_object",
    "load_reward",
    "load_tiny_config",
    "mask",
    "mask_value",
    "masked_repr",
    "package_version",
    "peft_weight_key",
    "quiet_third_party",
    "read_adapter_config",
    "read_samples",
    "register_environment",
    "register_secret",
    "register_url",
    "render_prompt",
    "run_rollout",
    "score_samples",
    "shown_line",
    "split_peft_weight_key",
    "write_samples",
]
