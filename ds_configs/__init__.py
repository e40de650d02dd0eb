"""DeepSpeed JSON configs shipped as package data."""
