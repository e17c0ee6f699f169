"""Tool calling on /v1/chat/completions (issue 20): tools rendered through the model's chat
template, the model's calls read back into OpenAI's tool_calls (streamed too), and with
tool_choice "required" or a named function the arguments constrained by the grammar engine to
the tool's parameter schema.

References, independent of the server:
- the prompt: a Jinja template of our own in the Qwen2.5/Hermes tool format (the format ChatML
  models are trained on), rendered with `jinja2` and tokenized with HF `tokenizers`, against
  what the server's /tokenize gives for the same messages and tools;
- the arguments: `jsonschema` against each tool's parameters;
- the auto-mode parser: outputs forced with a regex (so the test knows the text) and parsed by
  Python's `json`.
"""
import json

import jsonschema
import pytest

from lib.smol_hf import smol_hf_tokenizer
from lib.sanitize import SANITIZED

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time somewhere",
    "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "[A-Z][a-z]+/[A-Z][a-z]+"}},
        "required": ["zone"]}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, TIME, NOARGS]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
           for t in TOOLS}

# The Qwen2.5 / Hermes tool format, as a Jinja template written for this test.
REFERENCE = r"""
{%- set sys = messages[0].content if messages[0].role == 'system' else default_system -%}
{%- if tools -%}
<|im_start|>system
{{ sys }}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% else -%}
<|im_start|>system
{{ sys }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ m.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif -%}
{%- elif m.tool_calls -%}
<|im_start|>assistant
{%- if m.content %}
{{ m.content }}
{%- endif %}
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | fromjson | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
<|im_start|>assistant
"""


def reference_prompt(messages, tools):
    import jinja2
    env = jinja2.Environment(keep_trailing_newline=True)
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    env.filters["fromjson"] = json.loads
    text = env.from_string(REFERENCE).render(
        messages=messages, tools=tools,
        default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    return smol_hf_tokenizer().encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                         max_retries=0, timeout=300)


CONVERSATIONS = [
    [{"role": "user", "content": "Weather in Paris?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time in Tokyo?"}],
    [{"role": "user", "content": "Weather in Paris and Rome?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "a", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
         {"id": "b", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\", \"unit\": \"c\"}"}}]},
     {"role": "tool", "tool_call_id": "a", "content": "{\"temp\": 21}"},
     {"role": "tool", "tool_call_id": "b", "content": "18 degrees"},
     {"role": "assistant", "content": "Paris 21, Rome 18."},
     {"role": "user", "content": "Thanks"}],
]


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_prompt_matches_the_reference_template(server, conv):
    msgs = CONVERSATIONS[conv]
    st, body = server.post("/tokenize", {"messages": msgs, "tools": TOOLS})
    assert st == 200, body
    assert body["tokens"] == reference_prompt(msgs, TOOLS)


def check_calls(calls, allowed):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert len({c.id for c in calls}) == len(calls)


def test_required_calls_follow_the_schemas(client):
    for seed in range(1 if SANITIZED else 2):
        r = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
            tools=TOOLS, tool_choice="required", temperature=0.9, seed=seed, max_tokens=120)
        ch = r.choices[0]
        # parallel calls may run into max_tokens; every call that closed is valid
        assert ch.finish_reason in ("tool_calls", "length"), ch
        assert ch.message.content is None or ch.finish_reason == "length"
        check_calls(ch.message.tool_calls, SCHEMAS)


def test_named_function_and_no_parallel(client):
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What time is it in Europe?"}],
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False, temperature=0.7, seed=5, max_tokens=200)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert len(ch.message.tool_calls) == 1
    check_calls(ch.message.tool_calls, {"get_time"})


def test_streamed_calls_equal_the_whole_answer(client):
    kw = dict(model="smol", messages=[{"role": "user", "content": "Weather in Lima?"}],
              tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, finish = {}, None
    for ev in client.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += d.id or ""
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    got = [calls[i] for i in sorted(calls)]
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    ids = [c["id"] for c in got]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)


FORCED = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_mode_reads_calls_from_the_text(server, stream):
    """auto: the model decides; here a regex makes it write a call after some text, so the
    parser's reading can be checked exactly"""
    import re
    body = {"messages": [{"role": "user", "content": "Rome?"}], "tools": TOOLS,
            "tool_choice": "auto", "guided_regex": re.escape(FORCED), "max_tokens": 80,
            "temperature": 0, "stream": stream}
    if not stream:
        st, r = server.post("/v1/chat/completions", body)
        assert st == 200, r
        msg, finish = r["choices"][0]["message"], r["choices"][0]["finish_reason"]
        content, calls = msg["content"], msg.get("tool_calls") or []
    else:
        from lib.rawhttp import raw_http
        st, _, raw = raw_http(server.port, "POST", "/v1/chat/completions",
                              json.dumps(body).encode())
        assert st == 200
        content, calls, finish = "", [], None
        for ln in raw.decode().split("\n"):
            if not ln.startswith("data: ") or ln == "data: [DONE]":
                continue
            for ch in json.loads(ln[6:])["choices"]:
                content += ch["delta"].get("content") or ""
                calls += ch["delta"].get("tool_calls") or []
                finish = ch["finish_reason"] or finish
    assert finish == "tool_calls"
    assert content.strip() == "Let me check."
    assert len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}


@pytest.mark.parametrize("text", [
    "<tool_call>\nnot json\n</tool_call>",                 # a block that is no call stays text
    "Plain answer, no call.",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\"",  # cut: never closed
])
def test_auto_mode_keeps_what_is_not_a_call(server, text):
    import re
    st, r = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "?"}], "tools": TOOLS,
        "guided_regex": re.escape(text), "max_tokens": 80, "temperature": 0})
    assert st == 200, r
    ch = r["choices"][0]
    assert ch["message"]["content"] == text
    assert "tool_calls" not in ch["message"]
    assert ch["finish_reason"] == "stop"


def test_none_renders_but_does_not_parse(server):
    st, r = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "?"}], "tools": TOOLS, "tool_choice": "none",
        "guided_regex": "<tool_call>\\n\\{\\}\\n</tool_call>", "max_tokens": 40, "temperature": 0})
    assert st == 200, r
    assert r["choices"][0]["message"]["content"] == "<tool_call>\n{}\n</tool_call>"
    assert r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"x": {"type": "string", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_requests(server, body, param):
    st, r = server.post("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "?"}], **body})
    assert st == 400, r
    assert r["error"]["param"] == param, r


def test_tools_on_completions_is_refused(server):
    st, r = server.post("/v1/completions", {"prompt": "?", "tools": TOOLS})
    assert st == 400 and r["error"]["param"] == "tools"
