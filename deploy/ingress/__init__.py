"""The HTTP ingress's request path, Ray-free, in the order a request takes it:

``prepare`` (validate, template, tokenize, every limit: a typed ``Prepared``) -> ``planner``
(one prefix plan per prompt, shared by its choices and retries) -> ``dispatch`` (fan-out of the
choices, retry after a migration, P/D, behind the ``ReplicaPool`` protocol) -> ``render`` (one
accumulator per choice for whole and streamed answers). ``service.Ingress`` composes them;
``chat``/``completions``/``responses``/``ops`` hold each route's own part. Serve touches them
only through ``deploy.ingress.serve_pool`` and the routes in ``deploy.openai_api``.
"""
