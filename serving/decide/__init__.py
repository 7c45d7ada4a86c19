"""The decision API: `POST /decide`, `/decide/batch` and the laya-serve `/v1/systemone` routes.

`routes.DecideApi` is what the app factory mounts; a request flows routes -> schema (HTTP limits) ->
service (backend.prepare -> batcher -> backend.finish) -> policy, and laya does the deciding. Presets
and policies are operator files read at startup. Nothing here imports flask or torch at package import,
so `pagoda --help` stays cheap.
"""
