//! Completing the UDP checksums of the packets the link carries.
//!
//! A datagram a loopback socket sends to the link's namespace (the hub answering an agent:
//! its connection came in through the link and was sent on to loopback) is built for the
//! loopback device, which needs no checksum: the kernel leaves the UDP checksum to be
//! completed by the device. Routed out through the link's TUN device instead, it reaches the
//! harness as it was, and the namespace's kernel drops it as corrupt (`UdpInCsumErrors`). No
//! real link carries such packets, so the delay line completes the checksum of every IPv4 UDP
//! datagram it is given (a datagram whose checksum is already right is unchanged).

/// Completes the UDP checksum of `packet` if it is an IPv4 UDP datagram (anything else is
/// left alone, as is a datagram that is too short or a fragment).
pub fn complete_udp_checksum(packet: &mut [u8]) {
    const UDP: u8 = 17;
    if packet.len() < 20 || packet[0] >> 4 != 4 || packet[9] != UDP {
        return;
    }
    let header = usize::from(packet[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
    let fragment = u16::from_be_bytes([packet[6], packet[7]]) & 0x3fff;
    if header < 20 || total > packet.len() || total < header + 8 || fragment != 0 {
        return;
    }
    let (ip, rest) = packet[..total].split_at_mut(header);
    let udp_len = usize::from(u16::from_be_bytes([rest[4], rest[5]]));
    if udp_len != rest.len() {
        return;
    }
    rest[6] = 0;
    rest[7] = 0;
    let mut sum: u32 = 0;
    let mut add = |bytes: &[u8]| {
        let mut chunks = bytes.chunks_exact(2);
        for c in &mut chunks {
            sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
        }
        if let [last] = chunks.remainder() {
            sum += u32::from(*last) << 8;
        }
    };
    // The pseudo-header: source, destination, protocol, UDP length.
    add(&ip[12..20]);
    add(&[0, UDP]);
    add(&(udp_len as u16).to_be_bytes());
    add(rest);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let mut checksum = !(sum as u16);
    if checksum == 0 {
        // Zero means "no checksum" in UDP over IPv4; all ones stands for it.
        checksum = 0xffff;
    }
    rest[6..8].copy_from_slice(&checksum.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IPv4 UDP datagram 10.0.0.1:1000 → 10.0.0.2:2000 carrying `payload`, its checksum
    /// field set to `checksum`.
    fn datagram(payload: &[u8], checksum: u16) -> Vec<u8> {
        let total = 20 + 8 + payload.len();
        let mut p = vec![
            0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
        ];
        p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        p.extend_from_slice(&1000u16.to_be_bytes());
        p.extend_from_slice(&2000u16.to_be_bytes());
        p.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
        p.extend_from_slice(&checksum.to_be_bytes());
        p.extend_from_slice(payload);
        p
    }

    #[test]
    fn a_partial_checksum_is_completed_to_the_one_the_receiver_checks() {
        // By hand: the 16-bit words of the pseudo-header (0a00 0001 0a00 0002 0011 000b) and
        // of the datagram with its checksum zero (03e8 07d0 000b 0000 6869 2100) sum to
        // 0xa94b, so the checksum is !0xa94b = 0x56b4.
        let mut p = datagram(b"hi!", 0x1234);
        complete_udp_checksum(&mut p);
        assert_eq!(u16::from_be_bytes([p[26], p[27]]), 0x56b4);
        // Already right: unchanged.
        let before = p.clone();
        complete_udp_checksum(&mut p);
        assert_eq!(p, before);
    }

    #[test]
    fn what_is_not_a_whole_ipv4_udp_datagram_is_left_alone() {
        let mut tcp = datagram(b"hi!", 0x1234);
        tcp[9] = 6;
        let mut fragment = datagram(b"hi!", 0x1234);
        fragment[6] = 0x20;
        let mut short = datagram(b"hi!", 0x1234);
        short.truncate(24);
        for mut p in [tcp, fragment, short] {
            let before = p.clone();
            complete_udp_checksum(&mut p);
            assert_eq!(p, before);
        }
    }
}
