"""Which environment variables :mod:`mizzen_ci.masking` takes for secrets, through the real CLI
(argparse's usage error echoes an argument holding every value): the common shapes of secret
names (``*_PAT``, a provider's ``*_KEY``, ``*WEBHOOK*``, ``*CONNECTION_STRING*``, …) are
masked; names that only look alike (``PATH``, ``PWD``, ``SSH_AUTH_SOCK``, the run's
``MIZZEN_RUN_KEY``, ``TOKENIZERS_PARALLELISM``, …) are not, so their values stay readable."""

from __future__ import annotations

import os

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=3, labels=["ci"])

SECRET_NAMES = [
    "GITHUB_PAT", "OPENAI_KEY", "ANTHROPIC_KEY", "SIGNING_KEY", "SLACK_WEBHOOK_URL",
    "DISCORD_WEBHOOK", "AZURE_STORAGE_CONNECTION_STRING", "DB_CONN_STR", "DOCKER_CREDS",
    "SMTP_PASS", "DB_PWD", "NPM_AUTH", "HTTP_AUTHORIZATION", "GH_TOKEN", "HF_TOKEN",
    "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "PGPASSWORD", "SENTRY_DSN", "STRIPE_KEY",
    "GITHUB_APP_PRIVATE_KEY", "JWT_SECRET_KEY", "OPENAI_APIKEY",
]  # fmt: skip
PLAIN_NAMES = [
    "HOME", "PWD", "OLDPWD", "SSH_AUTH_SOCK", "PYTHONPATH_EXTRA", "CUDA_CACHE_PATH",
    "TOKENIZERS_PARALLELISM", "MIZZEN_RUN_KEY", "CACHE_KEY", "SSH_PUBLIC_KEY", "KEYBOARD",
    "BYPASS_FASTFAIL", "RAY_AUTH_MODE", "GITHUB_SHA", "PATTERN", "MAX_KEY_CHARS",
    # a key that names a thing, and PASS/PAT not as the last word: values CI must show
    "MIZZEN_HARBOR_REWARD_KEY", "MODEL_KEY", "SHARD_KEY", "DATASET_KEY", "CONCURRENCY_KEY",
    "LOCK_KEY", "MIZZEN_PASS_RATE", "PASS_AT_K", "PAT_LIMIT",
]  # fmt: skip


def _value(name: str) -> str:
    return f"value-of-{name.lower()}-{len(name)}"


def test_secret_names_are_masked_and_lookalikes_are_not(mizzen_ci):
    env = {name: _value(name) for name in SECRET_NAMES + PLAIN_NAMES}
    echoed = " ".join([os.environ.get("PATH", ""), *env.values()])
    out = mizzen_ci("gate", "show", "--window", echoed, env=env)
    assert out.returncode == 2 and "invalid int value" in out.stderr, out
    shown = {name for name in SECRET_NAMES + PLAIN_NAMES if _value(name) in out.stderr}
    assert shown == set(PLAIN_NAMES), out.stderr  # every secret masked, every lookalike shown
    assert os.environ.get("PATH", "") in out.stderr  # PATH itself is no secret
