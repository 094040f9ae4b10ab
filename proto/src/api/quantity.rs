//! Kubernetes resource quantities (`500m`, `16Gi`, `2`, `1.5e3`), as the agent sums them over
//! a spoke's nodes and the hub's placement prioritizers compare them: one parser for both ends.
//!
//! Values are kept in thousandths of the base unit (millicores, millibytes) as an `i128`, which
//! is exact for every quantity a node reports and far from overflow for any fleet.

/// A quantity in thousandths of its base unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Milli(pub i128);

impl Milli {
    /// The quantity as a float of base units (for scores, where exactness does not matter).
    pub fn as_f64(self) -> f64 {
        self.0 as f64 / 1000.0
    }
}

/// Parses a Kubernetes quantity; `None` for anything that is not one.
pub fn parse_quantity(s: &str) -> Option<Milli> {
    let s = s.trim();
    let (number, suffix) = split_suffix(s)?;
    let (negative, number) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number.strip_prefix('+').unwrap_or(number)),
    };
    if number.is_empty() {
        return None;
    }
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if !int_part.bytes().all(|b| b.is_ascii_digit())
        || !frac_part.bytes().all(|b| b.is_ascii_digit())
        || (int_part.is_empty() && frac_part.is_empty())
    {
        return None;
    }
    // value = digits * 10^exp10 * 2^exp2, computed in thousandths.
    let digits: i128 = format!("{int_part}{frac_part}").parse().ok()?;
    let mut exp10: i32 = 3 - frac_part.len() as i32;
    let mut exp2: u32 = 0;
    match suffix {
        Suffix::Decimal(e) => exp10 += e,
        Suffix::Binary(e) => exp2 = e,
    }
    let mut value = digits.checked_mul(1i128.checked_shl(exp2)?)?;
    if exp10 >= 0 {
        value = value.checked_mul(10i128.checked_pow(exp10 as u32)?)?;
    } else {
        // Below a thousandth: Kubernetes rounds up.
        let div = 10i128.checked_pow((-exp10) as u32)?;
        value = (value + div - 1) / div;
    }
    Some(Milli(if negative { -value } else { value }))
}

/// Writes a quantity back in Kubernetes' spelling: whole values with the largest binary suffix
/// that divides them (`16Gi`) when `binary`, else plain (`12`), and thousandths as `m`.
pub fn format_quantity(q: Milli, binary: bool) -> String {
    let m = q.0;
    if m % 1000 != 0 {
        return format!("{m}m");
    }
    let whole = m / 1000;
    if binary && whole != 0 {
        for (suffix, shift) in [
            ("Ei", 60),
            ("Pi", 50),
            ("Ti", 40),
            ("Gi", 30),
            ("Mi", 20),
            ("Ki", 10),
        ] {
            if whole % (1i128 << shift) == 0 {
                return format!("{}{suffix}", whole >> shift);
            }
        }
    }
    whole.to_string()
}

enum Suffix {
    Decimal(i32),
    Binary(u32),
}

fn split_suffix(s: &str) -> Option<(&str, Suffix)> {
    const BINARY: [(&str, u32); 6] = [
        ("Ki", 10),
        ("Mi", 20),
        ("Gi", 30),
        ("Ti", 40),
        ("Pi", 50),
        ("Ei", 60),
    ];
    for (suffix, e) in BINARY {
        if let Some(n) = s.strip_suffix(suffix) {
            return Some((n, Suffix::Binary(e)));
        }
    }
    // Decimal exponent: 1e3, 1E-2.
    if let Some(pos) = s.find(['e', 'E'])
        && pos > 0
        && let Ok(e) = s[pos + 1..].parse::<i32>()
    {
        return Some((&s[..pos], Suffix::Decimal(e)));
    }
    const DECIMAL: [(char, i32); 8] = [
        ('n', -9),
        ('u', -6),
        ('m', -3),
        ('k', 3),
        ('M', 6),
        ('G', 9),
        ('T', 12),
        ('P', 15),
    ];
    if let Some(last) = s.chars().last() {
        if let Some((_, e)) = DECIMAL.iter().find(|(c, _)| *c == last) {
            return Some((&s[..s.len() - 1], Suffix::Decimal(*e)));
        }
        if last == 'E' {
            return Some((&s[..s.len() - 1], Suffix::Decimal(18)));
        }
    }
    Some((s, Suffix::Decimal(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(input: &str, milli: Option<i128>) {
        assert_eq!(parse_quantity(input).map(|m| m.0), milli, "{input}");
    }

    #[test]
    fn parses_what_nodes_report() {
        check("2", Some(2000));
        check("500m", Some(500));
        check("1.5", Some(1500));
        check("16Gi", Some(16 * (1 << 30) * 1000));
        check("49265496Ki", Some(49_265_496 * 1024 * 1000));
        check("1k", Some(1_000_000));
        check("1e3", Some(1_000_000));
        check("100n", Some(1)); // rounded up to a thousandth
        check("-1", Some(-1000));
        check("", None);
        check("Gi", None);
        check("1.2.3", None);
        check("ten", None);
    }

    #[test]
    fn formats_back_in_kubernetes_spelling() {
        assert_eq!(format_quantity(Milli(24_000), false), "24");
        assert_eq!(format_quantity(Milli(22_500), false), "22500m");
        assert_eq!(
            format_quantity(parse_quantity("96488116Ki").unwrap(), true),
            "96488116Ki"
        );
        assert_eq!(
            format_quantity(parse_quantity("32Gi").unwrap(), true),
            "32Gi"
        );
        assert_eq!(format_quantity(Milli(1_000), true), "1");
    }
}
