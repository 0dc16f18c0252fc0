//! Git patches: one file's change as `git diff --binary --full-index` writes it, so that
//! `git apply` (and `git apply --cached`) accepts it.
//!
//! - headers `diff --git a/P b/P`, `new file mode`, `deleted file mode`, `old mode` /
//!   `new mode`, and a full `index OLD..NEW` line (git object ids, SHA-1);
//! - text as unified hunks (3 lines of context), compared byte for byte, line by line
//!   (`\n` ends a line), with `\ No newline at end of file` where a side lacks one;
//! - binary content (a NUL byte in its first 8 KiB, as the manifest says) as a
//!   `GIT binary patch`: a `literal` forward hunk and a `literal` reverse one, zlib data
//!   (stored blocks: valid, not compressed) in git's base 85;
//! - a symlink as mode 120000 whose content is its target; a file that becomes a symlink
//!   (or the reverse) as a deletion followed by a creation, as git writes it;
//! - paths quoted as git quotes them (C style, octal for bytes above 0x7f) when they hold
//!   a control character, a quote, a backslash or a non-ASCII byte.
//!
//! Binary hunks carry the SHA-1 object ids git checks them against: a patch for a
//! repository in SHA-256 object format applies its text but refuses its binary files.

use crate::manifest::MODE_SYMLINK;
use similar::{capture_diff_slices, group_diff_ops, Algorithm, DiffTag};
use std::fmt::Write as _;

/// Lines of context around each hunk (as `git diff`).
pub const PATCH_CONTEXT: usize = 3;

/// One side of a file's change: its manifest mode and bytes (a symlink's are its target).
#[derive(Debug, Clone, Copy)]
pub struct PatchSide<'a> {
    pub mode: u32,
    pub bytes: &'a [u8],
    /// The manifest's `binary` flag (a NUL byte in the first 8 KiB).
    pub binary: bool,
}

/// The null object id of an absent side.
const NULL_ID: &str = "0000000000000000000000000000000000000000";

/// The git mode of a manifest mode: `120000` for a symlink, `100755` for a file with any
/// execute bit, `100644` otherwise.
pub fn git_mode(mode: u32) -> u32 {
    if mode & 0o170000 == MODE_SYMLINK {
        0o120000
    } else if mode & 0o111 != 0 {
        0o100755
    } else {
        0o100644
    }
}

/// The git (SHA-1) object id of a blob holding `bytes`, as `git hash-object` prints it.
pub fn git_blob_id(bytes: &[u8]) -> String {
    let mut h = sha1_smol::Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    h.digest().to_string()
}

/// The patch of one file at workspace path `path`: `old` before (`None`: created), `new`
/// after (`None`: deleted). Empty when nothing changed (same bytes and git mode) or both
/// sides are absent.
pub fn git_patch(path: &str, old: Option<PatchSide<'_>>, new: Option<PatchSide<'_>>) -> Vec<u8> {
    let mut out = Vec::new();
    match (old, new) {
        (None, None) => {}
        (Some(o), Some(n)) if is_link(o.mode) != is_link(n.mode) => {
            // A change of type: git writes a deletion and a creation.
            file_patch(&mut out, path, Some(o), None);
            file_patch(&mut out, path, None, Some(n));
        }
        (o, n) => file_patch(&mut out, path, o, n),
    }
    out
}

fn is_link(mode: u32) -> bool {
    mode & 0o170000 == MODE_SYMLINK
}

fn file_patch(
    out: &mut Vec<u8>,
    path: &str,
    old: Option<PatchSide<'_>>,
    new: Option<PatchSide<'_>>,
) {
    let a = quote_path("a/", path);
    let b = quote_path("b/", path);
    let same_bytes = matches!((old, new), (Some(o), Some(n)) if o.bytes == n.bytes);
    let old_mode = old.map(|o| git_mode(o.mode));
    let new_mode = new.map(|n| git_mode(n.mode));
    if same_bytes && old_mode == new_mode {
        return;
    }
    let mut head = format!("diff --git {a} {b}\n");
    match (old_mode, new_mode) {
        (None, Some(m)) => {
            let _ = writeln!(head, "new file mode {m:06o}");
        }
        (Some(m), None) => {
            let _ = writeln!(head, "deleted file mode {m:06o}");
        }
        (Some(om), Some(nm)) if om != nm => {
            let _ = writeln!(head, "old mode {om:06o}\nnew mode {nm:06o}");
        }
        _ => {}
    }
    if same_bytes {
        // A mode change only: no index line, no hunks.
        out.extend_from_slice(head.as_bytes());
        return;
    }
    let old_id = old.map_or_else(|| NULL_ID.to_string(), |o| git_blob_id(o.bytes));
    let new_id = new.map_or_else(|| NULL_ID.to_string(), |n| git_blob_id(n.bytes));
    match (old_mode, new_mode) {
        (Some(om), Some(nm)) if om == nm => {
            let _ = writeln!(head, "index {old_id}..{new_id} {om:06o}");
        }
        _ => {
            let _ = writeln!(head, "index {old_id}..{new_id}");
        }
    }
    out.extend_from_slice(head.as_bytes());
    let old_bytes = old.map_or(&[][..], |o| o.bytes);
    let new_bytes = new.map_or(&[][..], |n| n.bytes);
    if old.is_some_and(|o| o.binary) || new.is_some_and(|n| n.binary) {
        out.extend_from_slice(b"GIT binary patch\n");
        binary_hunk(out, new_bytes);
        binary_hunk(out, old_bytes);
        return;
    }
    if old_bytes.is_empty() && new_bytes.is_empty() {
        return;
    }
    let tab = |p: &str| if p.contains(' ') { "\t" } else { "" };
    let minus = match old {
        Some(_) => format!("--- {a}{}\n", tab(path)),
        None => "--- /dev/null\n".to_string(),
    };
    let plus = match new {
        Some(_) => format!("+++ {b}{}\n", tab(path)),
        None => "+++ /dev/null\n".to_string(),
    };
    out.extend_from_slice(minus.as_bytes());
    out.extend_from_slice(plus.as_bytes());
    hunks(out, old_bytes, new_bytes);
}

/// The lines of `bytes`, each with its `\n` (the last one may lack it).
fn lines(bytes: &[u8]) -> Vec<&[u8]> {
    bytes.split_inclusive(|b| *b == b'\n').collect()
}

fn hunks(out: &mut Vec<u8>, old: &[u8], new: &[u8]) {
    let old_lines = lines(old);
    let new_lines = lines(new);
    let ops = capture_diff_slices(Algorithm::Myers, &old_lines, &new_lines);
    for group in group_diff_ops(ops, PATCH_CONTEXT) {
        let (Some(first), Some(last)) = (group.first(), group.last()) else {
            continue;
        };
        let old_range = first.old_range().start..last.old_range().end;
        let new_range = first.new_range().start..last.new_range().end;
        let header = format!(
            "@@ -{} +{} @@\n",
            hunk_range(old_range.start, old_range.len()),
            hunk_range(new_range.start, new_range.len())
        );
        out.extend_from_slice(header.as_bytes());
        for op in &group {
            let (tag, o, n) = op.as_tag_tuple();
            match tag {
                DiffTag::Equal => emit(out, b' ', old_lines.get(o).unwrap_or_default()),
                DiffTag::Delete => emit(out, b'-', old_lines.get(o).unwrap_or_default()),
                DiffTag::Insert => emit(out, b'+', new_lines.get(n).unwrap_or_default()),
                DiffTag::Replace => {
                    emit(out, b'-', old_lines.get(o).unwrap_or_default());
                    emit(out, b'+', new_lines.get(n).unwrap_or_default());
                }
            }
        }
    }
}

/// `start,count` as git writes it: 1-based; `,count` left out when 1; an empty range
/// names the line before it.
fn hunk_range(start: usize, count: usize) -> String {
    match count {
        0 => format!("{start},0"),
        1 => format!("{}", start + 1),
        n => format!("{},{n}", start + 1),
    }
}

fn emit(out: &mut Vec<u8>, prefix: u8, lines: &[&[u8]]) {
    for line in lines {
        out.push(prefix);
        out.extend_from_slice(line);
        if !line.ends_with(b"\n") {
            out.extend_from_slice(b"\n\\ No newline at end of file\n");
        }
    }
}

/// `literal SIZE`, the zlib stream of `bytes` in base 85 lines, an empty line.
fn binary_hunk(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(format!("literal {}\n", bytes.len()).as_bytes());
    let z = zlib_stored(bytes);
    for chunk in z.chunks(52) {
        // The line's length: A-Z for 1-26 bytes, a-z for 27-52.
        let n = chunk.len() as u8;
        out.push(if n <= 26 { b'A' + n - 1 } else { b'a' + n - 27 });
        encode_85(out, chunk);
        out.push(b'\n');
    }
    out.push(b'\n');
}

/// git's base 85 alphabet (`base85.c`).
const EN85: &[u8; 85] =
    b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%&()*+-;<=>?@^_`{|}~";

/// Each 4 bytes (the last group padded with zeros) as 5 characters, big end first.
fn encode_85(out: &mut Vec<u8>, data: &[u8]) {
    for group in data.chunks(4) {
        let mut acc: u32 = 0;
        for (i, b) in group.iter().enumerate() {
            acc |= u32::from(*b) << (24 - 8 * i);
        }
        let mut five = [0u8; 5];
        for slot in five.iter_mut().rev() {
            *slot = EN85[(acc % 85) as usize];
            acc /= 85;
        }
        out.extend_from_slice(&five);
    }
}

/// A zlib stream (RFC 1950) of `data` in stored (uncompressed) deflate blocks.
fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut z = Vec::with_capacity(data.len() + data.len() / 65535 * 5 + 16);
    z.extend_from_slice(&[0x78, 0x01]);
    let mut blocks = data.chunks(65535).peekable();
    if blocks.peek().is_none() {
        // One empty final block.
        z.extend_from_slice(&[0x01, 0x00, 0x00, 0xff, 0xff]);
    }
    while let Some(block) = blocks.next() {
        let last = blocks.peek().is_none();
        z.push(u8::from(last));
        let len = block.len() as u16;
        z.extend_from_slice(&len.to_le_bytes());
        z.extend_from_slice(&(!len).to_le_bytes());
        z.extend_from_slice(block);
    }
    z.extend_from_slice(&adler32(data).to_be_bytes());
    z
}

fn adler32(data: &[u8]) -> u32 {
    const MOD: u32 = 65521;
    let (mut a, mut b) = (1u32, 0u32);
    for chunk in data.chunks(5552) {
        for x in chunk {
            a += u32::from(*x);
            b += a;
        }
        a %= MOD;
        b %= MOD;
    }
    (b << 16) | a
}

/// `prefix` + `path`, in double quotes with C escapes when git would quote it.
fn quote_path(prefix: &str, path: &str) -> String {
    let name = format!("{prefix}{path}");
    let needs = name
        .bytes()
        .any(|b| b < 0x20 || b == b'"' || b == b'\\' || b >= 0x7f);
    if !needs {
        return name;
    }
    let mut q = String::from("\"");
    for b in name.bytes() {
        match b {
            b'\x07' => q.push_str("\\a"),
            b'\x08' => q.push_str("\\b"),
            b'\t' => q.push_str("\\t"),
            b'\n' => q.push_str("\\n"),
            b'\x0b' => q.push_str("\\v"),
            b'\x0c' => q.push_str("\\f"),
            b'\r' => q.push_str("\\r"),
            b'"' => q.push_str("\\\""),
            b'\\' => q.push_str("\\\\"),
            b if !(0x20..0x7f).contains(&b) => {
                let _ = write!(q, "\\{b:03o}");
            }
            b => q.push(char::from(b)),
        }
    }
    q.push('"');
    q
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{MODE_EXEC, MODE_FILE};

    fn side(bytes: &[u8], mode: u32) -> PatchSide<'_> {
        PatchSide {
            mode,
            bytes,
            binary: crate::blob::is_binary(bytes),
        }
    }

    fn text(p: Vec<u8>) -> String {
        String::from_utf8(p).unwrap()
    }

    #[test]
    fn blob_ids_are_gits() {
        // `git hash-object` of an empty file and of "hello\n".
        assert_eq!(git_blob_id(b""), "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391");
        assert_eq!(
            git_blob_id(b"hello\n"),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
    }

    #[test]
    fn a_modified_file_has_hunks_with_context_and_the_missing_newline_marker() {
        let old = b"1\n2\n3\n4\n5\n6\n7\n8\n9\n";
        let new = b"1\n2\n3\n4\nfive\n6\n7\n8\n9";
        let p = text(git_patch(
            "dir/f.txt",
            Some(side(old, MODE_FILE)),
            Some(side(new, MODE_FILE)),
        ));
        let want = format!(
            "diff --git a/dir/f.txt b/dir/f.txt\nindex {}..{} 100644\n--- a/dir/f.txt\n+++ b/dir/f.txt\n\
             @@ -2,8 +2,8 @@\n 2\n 3\n 4\n-5\n+five\n 6\n 7\n 8\n-9\n+9\n\\ No newline at end of file\n",
            git_blob_id(old),
            git_blob_id(new)
        );
        assert_eq!(p, want);
    }

    #[test]
    fn created_deleted_and_mode_only() {
        let p = text(git_patch("n", None, Some(side(b"x\n", MODE_EXEC))));
        assert!(p.starts_with("diff --git a/n b/n\nnew file mode 100755\nindex 0000000000000000000000000000000000000000.."), "{p}");
        assert!(
            p.ends_with("--- /dev/null\n+++ b/n\n@@ -0,0 +1 @@\n+x\n"),
            "{p}"
        );
        let p = text(git_patch("d", Some(side(b"a\nb\n", MODE_FILE)), None));
        assert!(p.contains("deleted file mode 100644\n"), "{p}");
        assert!(
            p.ends_with("--- a/d\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-a\n-b\n"),
            "{p}"
        );
        let p = text(git_patch(
            "x.sh",
            Some(side(b"a\n", MODE_FILE)),
            Some(side(b"a\n", MODE_EXEC)),
        ));
        assert_eq!(
            p,
            "diff --git a/x.sh b/x.sh\nold mode 100644\nnew mode 100755\n"
        );
        assert!(git_patch(
            "same",
            Some(side(b"a", MODE_FILE)),
            Some(side(b"a", MODE_FILE))
        )
        .is_empty());
        // An empty file created: headers, no hunk.
        let p = text(git_patch("e", None, Some(side(b"", MODE_FILE))));
        assert_eq!(
            p,
            "diff --git a/e b/e\nnew file mode 100644\nindex 0000000000000000000000000000000000000000..e69de29bb2d1d6434b8b29ae775ad8c2e48c5391\n"
        );
    }

    #[test]
    fn symlinks_and_type_changes() {
        let p = text(git_patch("l", None, Some(side(b"target", MODE_SYMLINK))));
        assert!(p.contains("new file mode 120000\n"), "{p}");
        assert!(
            p.ends_with("+target\n\\ No newline at end of file\n"),
            "{p}"
        );
        let p = text(git_patch(
            "l",
            Some(side(b"a\n", MODE_FILE)),
            Some(side(b"target", MODE_SYMLINK)),
        ));
        assert_eq!(p.matches("diff --git a/l b/l\n").count(), 2, "{p}");
        assert!(p.contains("deleted file mode 100644\n") && p.contains("new file mode 120000\n"));
    }

    #[test]
    fn binary_content_is_a_git_binary_patch() {
        let p = text(git_patch(
            "b.bin",
            None,
            Some(side(&[0, 1, 2, 255], MODE_FILE)),
        ));
        assert!(p.contains("GIT binary patch\nliteral 4\n"), "{p}");
        // The reverse hunk: nothing (11 zlib bytes, one line).
        assert!(p.contains("\n\nliteral 0\nK"), "{p}");
        assert!(p.ends_with("\n\n"), "{p}");
        // The zlib stream of nothing: a header, an empty stored block, adler32 of nothing.
        assert_eq!(
            zlib_stored(b""),
            [0x78, 0x01, 0x01, 0x00, 0x00, 0xff, 0xff, 0, 0, 0, 1]
        );
        assert_eq!(adler32(b"Wikipedia"), 0x11E6_0398);
        let mut e = Vec::new();
        encode_85(&mut e, &[0, 0, 0, 0]);
        assert_eq!(e, b"00000");
    }

    #[test]
    fn odd_paths_are_quoted_as_git_quotes_them() {
        assert_eq!(quote_path("a/", "plain/name.txt"), "a/plain/name.txt");
        assert_eq!(quote_path("a/", "tab\there"), "\"a/tab\\there\"");
        assert_eq!(quote_path("b/", "é"), "\"b/\\303\\251\"");
        let p = text(git_patch("with space", None, Some(side(b"x\n", MODE_FILE))));
        assert!(p.contains("+++ b/with space\t\n"), "{p}");
    }
}
