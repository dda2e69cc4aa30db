"""Measuring drafts and decoding: the paper's Section 6 analyses (`analysis`), rescorer weight tuning (`tuning`)
and the side-by-side benchmark (`bench`)."""
