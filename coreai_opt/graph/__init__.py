"""What the graph passes share: node and graph metadata, the op table, capture errors and small FX helpers.

Nothing here transforms a graph (the passes are :mod:`coreai_opt.passes`); every module reads or builds one
piece the passes, the API and the exporter rely on. Node decisions live in ``node.meta["coreai_opt"]``
(:mod:`~coreai_opt.graph.node_meta`), graph-level facts in ``gm.meta["coreai_opt"]``
(:mod:`~coreai_opt.graph.graph_meta`).
"""
