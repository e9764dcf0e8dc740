"""``splitserve plan``: measure this machine with the engine, simulate every layout a resource allows, recommend one.

``workload`` (shapes and traces), ``costs`` (the cost model and its cache), ``routing`` and ``simulate`` (the
discrete-event model) and ``recommend`` (candidates, ranking, the written resource) are torch-free;
``calibrate`` imports the engine only when it measures; ``command`` runs the CLI command. See docs/planner.md.
"""
