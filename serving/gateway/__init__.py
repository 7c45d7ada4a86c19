"""The co-deploy gateway: one endpoint in front of generation servers (pagoda, vLLM, SGLang, llama.cpp).

Requests pass through to an upstream as sent and answers come back as they arrive; the gateway adds the
control plane around them: health checks that take failing upstreams out of rotation, failures answered
as 502/504 naming the upstream, per-upstream metrics, and routing by a Laya decision about the request.
`pagoda gateway` runs it (docs/gateway.md).
"""
