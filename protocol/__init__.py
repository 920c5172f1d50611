"""GPUFlex protocol package."""
