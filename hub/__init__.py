"""GPUFlex hub package."""
