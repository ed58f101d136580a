"""Every request field of vLLM v0.33's schemas is declared by rollbus's request models, so none is dropped
unread: it is implemented, accepted because it changes no output, or refused (400 naming it) when it asks
for something rollbus does not do. The field lists are vLLM v0.33's (vllm/entrypoints/openai/*/protocol.py,
scale_out/token_in_token_out/protocol.py, vllm/sampling_params.py); a vLLM upgrade adds its new fields here.
"""

from __future__ import annotations

import pytest

from gateway.protocol import (
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    REFUSED_ENGINE_SAMPLING,
    REFUSED_GENERATE,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateSamplingParams,
)
from gateway.responses_protocol import ResponsesRequest
from tests.gateway_bad_inputs import ASKING_CHAT, ASKING_COMPLETION, ASKING_ENGINE_SAMPLING, ASKING_GENERATE

VLLM_V033_FIELDS = {
    CompletionRequest: """
        model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed
        stop stream stream_options suffix temperature top_p user use_beam_search top_k min_p
        repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output
        ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens
        truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs logprob_token_ids
        bad_words prompt_embeds add_special_tokens response_format structured_outputs priority
        request_id session_id return_tokens_as_token_ids return_token_ids return_weight_versions
        routed_experts_prompt_start return_token_offsets mm_payload return_mm_kwargs cache_salt
        kv_transfer_params ec_transfer_params vllm_xargs repetition_detection thinking_token_budget
        stream_interval
    """.split(),
    ChatCompletionRequest: """
        messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens
        max_completion_tokens n presence_penalty response_format seed stop stream stream_options
        temperature top_p tools tool_choice reasoning_effort thinking_token_budget include_reasoning
        parallel_tool_calls user use_beam_search top_k min_p repetition_penalty watermarking
        length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
        skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side
        prompt_logprobs logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt
        continue_final_message add_special_tokens documents chat_template chat_template_kwargs
        media_io_kwargs mm_processor_kwargs structured_outputs priority request_id session_id
        return_tokens_as_token_ids return_token_ids return_weight_versions
        routed_experts_prompt_start return_token_offsets return_prompt_text mm_payload
        return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs
        repetition_detection stream_interval
    """.split(),
    GenerateRequest: """
        request_id token_ids token_offsets features content_parts sampling_params model
        reasoning_ended reasoning_parser_kwargs return_token_ids output_mode parse_context stream
        stream_options cache_salt priority kv_transfer_params ec_transfer_params
    """.split(),
    GenerateSamplingParams: """
        n presence_penalty frequency_penalty repetition_penalty temperature watermarking top_p top_k
        min_p seed stop stop_token_ids ignore_eos max_tokens min_tokens logprobs prompt_logprobs
        prompt_logprob_token_ids prompt_logprob_start logprob_token_ids flat_logprobs detokenize
        skip_special_tokens spaces_between_special_tokens include_stop_str_in_output output_kind
        stream_interval skip_clone output_text_buffer_length structured_outputs logit_bias
        allowed_token_ids extra_args bad_words skip_reading_prefix_cache thinking_token_budget
        repetition_detection routed_experts_prompt_start trace_decode_token_ids
    """.split(),
    ResponsesRequest: """
        background include input instructions max_output_tokens max_tool_calls metadata model logit_bias
        parallel_tool_calls previous_response_id prompt reasoning service_tier store stream temperature text
        tool_choice tools top_logprobs top_p top_k truncation user skip_special_tokens include_stop_str_in_output
        prompt_cache_key request_id mm_processor_kwargs priority cache_salt enable_response_messages
        previous_input_messages previous_response structured_outputs repetition_penalty seed stop ignore_eos
        vllm_xargs
    """.split(),
}


@pytest.mark.parametrize("model", list(VLLM_V033_FIELDS), ids=lambda m: m.__name__)
def test_every_vllm_field_is_declared(model) -> None:
    missing = [f for f in VLLM_V033_FIELDS[model] if f not in model.model_fields]
    assert not missing, f"{model.__name__} would drop these vLLM fields unread: {missing}"


@pytest.mark.parametrize("table, asking", [(REFUSED_COMPLETION, ASKING_COMPLETION), (REFUSED_CHAT, ASKING_CHAT),
                                           (REFUSED_ENGINE_SAMPLING, ASKING_ENGINE_SAMPLING),
                                           (REFUSED_GENERATE, ASKING_GENERATE)])
def test_every_refused_field_has_an_http_case(table, asking) -> None:
    """tests/gateway_bad_inputs.py sends each refused field with a value that asks for something."""
    assert set(table) <= set(asking), sorted(set(table) - set(asking))
