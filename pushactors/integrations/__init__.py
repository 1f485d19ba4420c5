"""Engine integrations. Each imports its engine; ``import pushactors`` imports none of them."""
