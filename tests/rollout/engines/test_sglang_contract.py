"""The protocol is pinned to the real SGLang: every field the client sends and every field the
embedded server accepts is checked against SGLang's own request definitions, read with ``ast``
from the source files of its wheel (``sglang`` is never imported: no CUDA, no dependencies).

The wheel is PyPI's ``sglang==0.5.23`` (``sglang_wheel`` in this folder's conftest: downloaded
once with ``pip download``, sha256-pinned; no wheel is a failure, not a skip).  Checked:

- the client's payloads (built by :mod:`mizzen_rollout.engines.protocol` from requests that use
  every option) name only fields SGLang's struct defines, each with a JSON value of a type the
  field's annotation names (``GenerateReqInput``, ``SamplingParams``, ``ChatCompletionRequest``
  and its messages, ``AbortReq``, ``TokenizeRequest``, ``UpdateWeightFromDiskReqInput``,
  ``LoadLoRAAdapterReqInput``, ``UnloadLoRAAdapterReqInput``);
- the fields of the server's pydantic models (:mod:`mizzen_rollout.engines.embedded.schema`)
  are fields of the same structs;
- every endpoint path mizzen uses is a route of SGLang's ``http_server.py``;
- the check is not vacuous: a planted field the client would send, or the server would accept,
  makes it report that field.
"""

from __future__ import annotations

import ast
import zipfile
from typing import Any

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.engines import protocol
from mizzen_rollout.engines.base import ChatRequest, GenerateRequest, SamplingParams
from mizzen_rollout.engines.embedded import schema

register_cpu_ci(est_time=10, labels=["engine", "rollout"])

IO_STRUCT = "sglang/srt/managers/io_struct.py"
OPENAI = "sglang/srt/entrypoints/openai/protocol.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
#: shape -> (SGLang source file, class), and the server model that accepts that shape
STRUCTS = {
    "generate": (IO_STRUCT, "GenerateReqInput", "GenerateReqInput"),
    "sampling_params": (SAMPLING, "SamplingParams", "SamplingParamsInput"),
    "chat": (OPENAI, "ChatCompletionRequest", "ChatCompletionRequest"),
    "chat_message": (OPENAI, "ChatCompletionMessageGenericParam", "ChatMessage"),
    "abort": (IO_STRUCT, "AbortReq", "AbortReq"),
    "tokenize": (OPENAI, "TokenizeRequest", "TokenizeReqInput"),
    "update_weights": (IO_STRUCT, "UpdateWeightFromDiskReqInput", "UpdateWeightFromDiskReqInput"),
    "load_lora": (IO_STRUCT, "LoadLoRAAdapterReqInput", "LoadLoRAAdapterReqInput"),
    "unload_lora": (IO_STRUCT, "UnloadLoRAAdapterReqInput", "UnloadLoRAAdapterReqInput"),
}
#: what a JSON value's type may be called in an annotation
JSON_TYPE_NAMES = {
    bool: ("bool",),
    int: ("int",),
    float: ("float",),
    str: ("str",),
    list: ("List", "list", "Set", "Sequence", "Tuple"),
    dict: ("Dict", "dict", "Mapping"),
}


def class_fields(tree: ast.Module, name: str) -> dict[str, str]:
    """Annotated fields of class ``name`` and of its bases defined in the same module (public
    names only), each with its annotation as source text, module-level aliases expanded."""
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    aliases = {
        n.targets[0].id: ast.unparse(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
    }
    fields: dict[str, str] = {}
    pending = [name]
    while pending:
        node = classes[pending.pop()]
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                field = stmt.target.id
                if not field.startswith("_") and field not in fields:
                    text = ast.unparse(stmt.annotation)
                    fields[field] = " ".join([text, *(aliases.get(w, "") for w in _words(text))])
        pending += [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
    return fields


def _words(text: str) -> list[str]:
    return [w for w in text.replace("[", " ").replace("]", " ").replace(",", " ").split() if w]


def violations(shape: str, payload: dict[str, Any], fields: dict[str, str]) -> list[str]:
    """Fields of ``payload`` that SGLang's struct for ``shape`` does not define, or whose value's
    JSON type its annotation does not name."""
    struct = STRUCTS[shape][1]
    found = []
    for key, value in payload.items():
        if key not in fields:
            found.append(f"{shape}: '{key}' is not a field of SGLang's {struct}")
            continue
        names = JSON_TYPE_NAMES[bool if isinstance(value, bool) else type(value)]
        words = set(_words(fields[key].replace("|", " ")))
        if not words & {*names, "Any"} and not (isinstance(value, str) and "Literal" in words):
            found.append(
                f"{shape}: '{key}' is sent as {type(value).__name__}; SGLang's {struct}.{key} is "
                f"{fields[key]}"
            )
    return found


@pytest.fixture(scope="module")
def sglang(sglang_wheel) -> dict[str, Any]:
    """{shape: {field: annotation}} and the route strings of SGLang's HTTP server."""
    with zipfile.ZipFile(sglang_wheel) as wheel:
        trees = {
            path: ast.parse(wheel.read(path).decode("utf-8"))
            for path in {IO_STRUCT, OPENAI, SAMPLING, HTTP_SERVER}
        }
    shapes = {shape: class_fields(trees[path], cls) for shape, (path, cls, _) in STRUCTS.items()}
    routes = {
        node.value
        for node in ast.walk(trees[HTTP_SERVER])
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value[:1] == "/"
    }
    return {"shapes": shapes, "routes": routes}


FULL_SAMPLING = SamplingParams(
    max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, stop=["\n"],
    stop_token_ids=[2], ignore_eos=True, seed=3,
)  # fmt: skip


def client_payloads() -> list[tuple[str, dict[str, Any]]]:
    """(shape, payload) for everything the client sends, every option set."""
    by_text = GenerateRequest("g1", text="hi", sampling=FULL_SAMPLING, return_logprob=True)
    by_ids = GenerateRequest("g2", input_ids=[5, 6], sampling=FULL_SAMPLING, lora_path="a@v1")
    chat = protocol.build_chat_payload(
        ChatRequest("c1", [{"role": "user", "content": "hi"}], sampling=FULL_SAMPLING,
                    return_logprob=True, return_token_ids=True, lora_name="a@v1")
    )  # fmt: skip
    batch = protocol.build_generate_batch_payload([by_ids, GenerateRequest("g3", input_ids=[7])])
    payloads = [
        ("generate", protocol.build_generate_payload(by_text)),
        ("generate", protocol.build_generate_payload(by_ids)),
        ("generate", batch),
        ("chat", chat),
        ("abort", protocol.build_abort_payload("g1")),
        ("tokenize", protocol.build_tokenize_payload("hi")),
        ("update_weights", protocol.build_update_weights_payload("/models/step-3")),
        ("load_lora", protocol.build_load_lora_payload("a@v1", "/adapters/a", pinned=True)),
        ("unload_lora", protocol.build_unload_lora_payload("a@v1")),
    ]
    nested = [("sampling_params", p["sampling_params"]) for s, p in payloads if s == "generate"]
    nested = [
        (s, one) for s, value in nested for one in (value if isinstance(value, list) else [value])
    ]
    messages = [("chat_message", m) for m in chat["messages"]]
    return payloads + nested + messages


def test_every_field_the_client_sends_is_sglangs(sglang):
    shapes = sglang["shapes"]
    found = [
        v for shape, payload in client_payloads() for v in violations(shape, payload, shapes[shape])
    ]
    assert found == []


def test_every_field_the_server_accepts_is_sglangs(sglang):
    for shape, (_, struct, model_name) in STRUCTS.items():
        accepted = set(getattr(schema, model_name).model_fields)
        unknown = sorted(accepted - set(sglang["shapes"][shape]))
        assert unknown == [], f"the server's {model_name} accepts {unknown}, not fields of {struct}"


def test_every_endpoint_is_an_sglang_route(sglang):
    paths = {
        protocol.GENERATE_PATH, protocol.CHAT_PATH, protocol.ABORT_PATH, protocol.HEALTH_PATH,
        protocol.HEALTH_GENERATE_PATH, protocol.TOKENIZE_PATH, protocol.MODEL_INFO_PATH,
        protocol.UPDATE_WEIGHTS_PATH, protocol.LOAD_LORA_PATH, protocol.UNLOAD_LORA_PATH,
    }  # fmt: skip
    assert sorted(paths - sglang["routes"]) == []


def test_the_contract_catches_a_planted_field(sglang):
    """The checks are not vacuous: a field SGLang does not define, or a value of the wrong type,
    is reported by name."""
    shapes = sglang["shapes"]
    payload = protocol.build_generate_payload(GenerateRequest("g", text="hi"))
    planted = {**payload, "temperature_boost": 2.0}
    assert violations("generate", planted, shapes["generate"]) == [
        "generate: 'temperature_boost' is not a field of SGLang's GenerateReqInput"
    ]
    wrong_type = {**payload["sampling_params"], "max_new_tokens": "8"}
    assert violations("sampling_params", wrong_type, shapes["sampling_params"]) == [
        "sampling_params: 'max_new_tokens' is sent as str; SGLang's SamplingParams.max_new_tokens "
        f"is {shapes['sampling_params']['max_new_tokens']}"
    ]
    server_fields = set(schema.LoadLoRAAdapterReqInput.model_fields) | {"lora_int_id"}
    assert server_fields - set(shapes["load_lora"]) == {"lora_int_id"}
    assert "/generate_planted" not in sglang["routes"]


def test_class_fields_follow_bases_and_aliases():
    tree = ast.parse(
        "Role = Literal['user']\n"
        "class Base:\n    rid: Optional[str] = None\n    _private: int = 0\n"
        "class Req(Base):\n    name: str\n    role: Role\n"
    )
    fields = class_fields(tree, "Req")
    assert set(fields) == {"name", "role", "rid"}
    assert "Literal" in fields["role"]
