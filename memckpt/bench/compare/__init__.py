"""``memckpt bench compare``: memckpt side by side with torch.save, DCP async_save and Ray Train.

``command`` (arguments, the run, ``main``), ``measure``, ``rows``, ``report``;
``alternatives``: the methods memckpt is compared with; ``plot``: the PNG.
"""
