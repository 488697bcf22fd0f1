"""Relevance: the score's relevance handed back through the model to its input, conserved on the way.

One engine for LRP, AttnLRP, CP-LRP and CRP: ``operations.py`` runs each torch operation of the model's forward
under its rule (ε, identity, gate, softmax, layer norm, a composite's rule for a layer); ``rules.py`` holds LRP's
rules for a layer (ε, z⁺, αβ, γ, z^B, flat); ``composites.py`` says which layer gets which rule; ``epsilon.py``
the one stabilized ratio; ``propagation.py`` the methods (``lrp``, ``attnlrp``, ``cplrp``).
"""
