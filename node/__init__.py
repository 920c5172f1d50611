"""GPUFlex node package."""
