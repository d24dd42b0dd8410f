"""Private implementation of jmp_rewrite. Import from `jmp_rewrite`, not from here."""
