"""pagoda's HTTP server: a small core and one sub-package per API.

The core (`app`, `access_log`, `auth`, `errors`, `metrics`, `openapi`, `config`/`flags`, `server`) is
what every API needs the same way: one error shape, request ids and access lines, bearer auth, per-route
metrics, one OpenAPI document, settings from flags and `PAGODA_*` variables, gunicorn. Each API (today
`serving.decide`: Laya decisions over `/decide` and laya-serve's `/v1/systemone`) brings its routes,
settings, series and schemas, so the generation API and the co-deploy gateway can be added beside it
rather than into it. `serving.cli` is also the `pagoda` command's entry point for every package.
"""
