"""The control plane's decisions at scale, without a cluster: ``plan`` times placement and
the recovery plan over a synthetic job of thousands of ranks."""
