"""pagoda's HTTP server: a small core and one sub-package per API.

The core (`app`, `access_log`, `auth`, `errors`, `metrics`, `openapi`, `config`/`flags`, `server`) is
what every API needs the same way: one error shape, request ids and access lines, bearer auth, per-route
metrics, request-thread budgets per API, one OpenAPI document, settings from flags and `PAGODA_*`
variables, gunicorn. Each API brings its routes, settings, series and schemas: `serving.decide` (Laya
decisions over `/decide` and laya-serve's `/v1/systemone`) and `serving.generate` (the LLM over OpenAI's
API, SGLang's `/generate` and pins); the co-deploy gateway will be added beside them rather than into
them. `serving.cli` is also the `pagoda` command's entry point for every package.
"""
