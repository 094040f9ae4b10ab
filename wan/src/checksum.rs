//! UDP checksums of the IPv4 packets a link carries, made right before they are held.
//!
//! The emulator's own address translation breaks some: a reply from a loopback service to the
//! namespace (translated back from 127.0.0.1 to the link's host end) that the sender's kernel
//! built as one UDP segmentation-offload batch (`UDP_SEGMENT`, as QUIC stacks send) is split
//! in software after the translation, and the segments reach the namespace with a checksum
//! of the untranslated addresses, which its kernel drops (`InCsumErrors`). A real path has no
//! such translation (or a NIC that finishes the checksum after it), so the delay line puts in
//! the checksum the packet's own bytes call for: every datagram arrives as sent.

/// IANA's protocol number of UDP.
const UDP: u8 = 17;

/// Sets the UDP checksum of `packet` (an IPv4 packet, as a TUN device gives it) to the one
/// its addresses and bytes call for. Anything else (IPv6, not UDP, a fragment, truncated, a
/// zero checksum, which IPv4 UDP may send to mean none) is left as it is.
pub fn complete_udp(packet: &mut [u8]) {
    let Some(&first) = packet.first() else {
        return;
    };
    let header = usize::from(first & 0x0f) * 4;
    if first >> 4 != 4 || header < 20 || packet.len() < header + 8 || packet[9] != UDP {
        return;
    }
    // More fragments, or a fragment offset: the datagram is not all here.
    if u16::from_be_bytes([packet[6], packet[7]]) & 0x3fff != 0 {
        return;
    }
    let total = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
    let udp_len = usize::from(u16::from_be_bytes([packet[header + 4], packet[header + 5]]));
    if total > packet.len() || total < header + 8 || udp_len != total - header {
        return;
    }
    if packet[header + 6..header + 8] == [0, 0] {
        return;
    }
    packet[header + 6] = 0;
    packet[header + 7] = 0;
    let mut sum: u32 = 0;
    let mut add = |bytes: &[u8]| {
        for pair in bytes.chunks(2) {
            let word = u16::from_be_bytes([pair[0], pair.get(1).copied().unwrap_or(0)]);
            sum += u32::from(word);
        }
    };
    // The pseudo-header: source, destination, protocol, UDP length.
    add(&packet[12..20]);
    add(&[0, UDP]);
    add(&(udp_len as u16).to_be_bytes());
    add(&packet[header..total]);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    // A computed 0 is sent as all ones: 0 means "no checksum".
    let check = match !(sum as u16) {
        0 => 0xffff,
        c => c,
    };
    packet[header + 6..header + 8].copy_from_slice(&check.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IPv4 UDP packet from 10.0.0.1:1234 to 10.0.0.2:80 with `payload` and checksum
    /// `check`.
    fn packet(payload: &[u8], check: [u8; 2]) -> Vec<u8> {
        let total = (20 + 8 + payload.len()) as u16;
        let mut p = vec![
            0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, UDP, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
        ];
        p[2..4].copy_from_slice(&total.to_be_bytes());
        p.extend_from_slice(&1234u16.to_be_bytes());
        p.extend_from_slice(&80u16.to_be_bytes());
        p.extend_from_slice(&(total - 20).to_be_bytes());
        p.extend_from_slice(&check);
        p.extend_from_slice(payload);
        p
    }

    #[test]
    fn a_wrong_checksum_is_replaced_by_the_right_one() {
        // Known answers, computed independently with RFC 1071's sum.
        let mut p = packet(b"hi!!", [0xde, 0xad]);
        complete_udp(&mut p);
        assert_eq!(&p[26..28], &[0x5d, 0x27]);
        // Right already: unchanged.
        let right = p.clone();
        complete_udp(&mut p);
        assert_eq!(p, right);
        // An odd length is summed as if padded with a zero byte.
        let mut odd = packet(b"hi!", [0, 1]);
        complete_udp(&mut odd);
        assert_eq!(&odd[26..28], &[0x5d, 0x4a]);
    }

    #[test]
    fn what_is_not_a_whole_ipv4_udp_datagram_with_a_checksum_is_left_alone() {
        let no_checksum = packet(b"hi!!", [0, 0]);
        let mut tcp = packet(b"hi!!", [0xde, 0xad]);
        tcp[9] = 6;
        let mut fragment = packet(b"hi!!", [0xde, 0xad]);
        fragment[6] = 0x20;
        let mut truncated = packet(b"hi!!", [0xde, 0xad]);
        truncated.truncate(30);
        let mut ipv6 = packet(b"hi!!", [0xde, 0xad]);
        ipv6[0] = 0x60;
        for original in [no_checksum, tcp, fragment, truncated, ipv6, Vec::new()] {
            let mut p = original.clone();
            complete_udp(&mut p);
            assert_eq!(p, original);
        }
    }
}
