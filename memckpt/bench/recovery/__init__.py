"""``memckpt bench recovery``: a killed worker or a lost node against restart + torch.load.

``command`` (arguments, the run, ``main``), ``measure`` (the measurements on one local Ray
cluster), ``rows`` (the rows built from them), ``report``; ``workload`` and ``bench_actors``: the
synthetic training job and the Ray actors the measurements run.
"""
