"""The generation API: OpenAI's `/v1/chat/completions`, `/v1/completions`, SGLang's `/generate` and friends,
and pins (KV prefixes kept resident) over HTTP, all on the engine's continuous batch.

`routes.GenerateApi` is what the app factory mounts. A request flows routes -> schema (what HTTP owes:
shapes, types, caps, unsupported fields) -> service (chat template, tokens, pins, `SamplingParams`, one
`EngineLoop.submit_batch`) -> the dialect that writes the answer (`openai`, `sglang`), streamed through
`streaming` when asked. The engine decides what values mean (its `InvalidParam` names the field, which the
service maps back to the HTTP name). Nothing here imports torch at package import, so `pagoda --help` and
an edge install without torch stay cheap.
"""
