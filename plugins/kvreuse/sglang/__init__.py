"""SGLang adapter: thin classes that translate between SGLang's interfaces and kvreuse's engine-free cores."""
