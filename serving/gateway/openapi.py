"""The gateway's part of `/openapi.json`: the forwarded routes.

Their bodies and answers are the upstream's (the generation API's schemas when the upstream is
`pagoda serve`; vLLM's, SGLang's or llama.cpp's otherwise), so they are documented as objects passed
through; what the gateway adds is its headers and its own errors (502 and 504 naming the upstream).
"""

from __future__ import annotations

from serving.openapi import json_content, ref

HEADERS = {
    "X-Pagoda-Route": "the upstream group that took the request",
    "X-Pagoda-Route-Reason": "rule, default, explicit (the request's model named the group), fallback (the group "
                             "picked had no healthy upstream) or decision_failed (the default, for want of one)",
    "X-Pagoda-Upstream": "the upstream server that answered",
    "X-Pagoda-Decision-Ms": "time the routing decision took (only when one ran)",
}
ERRORS = {"401": "missing or wrong bearer token", "413": "body over the size limit",
          "502": "the upstream refused the connection, broke it, or answered something that is not HTTP",
          "503": "all request threads busy (Retry-After)", "504": "the upstream did not answer in time"}


def openapi() -> dict:
    def route(summary: str, error: str, broken: str = "an error event and data: [DONE]") -> dict:
        headers = {name: {"description": text, "schema": {"type": "string"}} for name, text in HEADERS.items()}
        content = {**json_content(ref("Object"))["content"],
                   "text/event-stream": {"schema": {"type": "string", "description": "the upstream's SSE events; "
                                                    f"a stream the upstream broke ends with {broken}"}}}
        return {"post": {"summary": summary,
                         "requestBody": {"required": True, **json_content(ref("Object"))},
                         "responses": {"200": {"description": "the upstream's answer, as it sent it",
                                               "headers": headers, "content": content},
                                       **{code: {"description": text, **json_content(ref(error))}
                                          for code, text in ERRORS.items()}}}}

    return {"paths": {"/v1/chat/completions": route("OpenAI chat completions, passed to the routed upstream",
                                                    "GatewayOpenAIError"),
                      "/v1/completions": route("OpenAI completions, passed to the routed upstream",
                                               "GatewayOpenAIError"),
                      "/v1/responses": route("OpenAI Responses API, passed to the routed upstream",
                                             "GatewayOpenAIError", "a typed error event (event: error)"),
                      "/generate": route("SGLang generate, passed to the routed upstream", "Error"),
                      "/get_model_info": {"get": {
                          "summary": "SGLang model info, the default group's upstream's (RuntimeEndpoint reads it first)",
                          "responses": {"200": {"description": "the upstream's answer, as it sent it",
                                                **json_content(ref("Object"))},
                                        **{code: {"description": text, **json_content(ref("Error"))}
                                           for code, text in ERRORS.items() if code != "413"}}}}},
            "schemas": {"GatewayOpenAIError": {
                "type": "object", "required": ["error"],
                "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"],
                                         "properties": {k: {"type": ["string", "null"]}
                                                        for k in ("message", "type", "param", "code")}}}}}}
