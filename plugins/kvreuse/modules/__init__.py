"""Position-independent module cache (engine-free core): prompt modules encoded once and spliced at any position."""
