//! The synthetic vocabulary of the digit tasks: three special tokens, then the ten digits.

use crate::generation::Token;

/// Start of a prompt, `<s>`.
pub const BOS: Token = 0;
/// End of the question, `=`: the answer follows.
pub const SEP: Token = 1;
/// End of an answer, `</s>`.
pub const EOS: Token = 2;
/// Token of digit 0 (digits `0..=9` are `ZERO..ZERO + 10`).
pub const ZERO: Token = 3;
/// Number of digits.
pub const DIGITS: u8 = 10;
/// Size of the vocabulary.
pub const VOCAB: usize = ZERO as usize + DIGITS as usize;

/// The token of digit `d` (`0..=9`).
pub fn digit(d: u8) -> Token {
    ZERO + Token::from(d)
}

/// The digit of a token, if it is one.
pub fn token_digit(t: Token) -> Option<u8> {
    t.checked_sub(ZERO)
        .filter(|d| *d < Token::from(DIGITS))
        .and_then(|d| u8::try_from(d).ok())
}

/// Tokens as text: `<s>`, `=`, `</s>`, digits, `?` for anything else.
pub fn render(tokens: &[Token]) -> String {
    tokens
        .iter()
        .map(|&t| match t {
            BOS => "<s>".to_string(),
            SEP => "=".to_string(),
            EOS => "</s>".to_string(),
            t => token_digit(t).map_or_else(|| "?".to_string(), |d| d.to_string()),
        })
        .collect::<Vec<_>>()
        .join("")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_round_trip() {
        for d in 0..DIGITS {
            assert_eq!(token_digit(digit(d)), Some(d));
        }
        assert_eq!(token_digit(EOS), None);
        assert_eq!(token_digit(VOCAB as Token), None);
        assert_eq!(render(&[BOS, digit(4), digit(2), SEP, EOS]), "<s>42=</s>");
    }
}
