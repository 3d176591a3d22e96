"""Labelling: which images to send to annotators next (active learning), and the near-duplicate
filter that keeps copies of training images, and of each other, out of a labelling budget.

- `select`: pure-numpy selection strategies over a `Pool` of model outputs (uncertainty,
  k-center diversity, a hybrid of both, class balance, random), deterministic for a seed;
- `phash`: 64-bit DCT perceptual hashes and a vectorised Hamming-distance duplicate search.
"""
