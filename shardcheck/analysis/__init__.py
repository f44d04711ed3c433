"""What the graph computes: shapes, element types, attention layers, sequence axes."""
