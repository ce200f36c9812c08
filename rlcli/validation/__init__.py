"""Loading a recipe and checking it: relations between keys, registry names, layouts, the model's config.json."""
