"""Programs built on splash_hk, kept beside the library (not in its wheel); run from the checkout."""
