"""Every pure decision: nodes, ranks and observations in, a decision out. No Ray, no torch."""
