"""Documents to text: plain text, PDF and DOCX, with limits against bombs."""
